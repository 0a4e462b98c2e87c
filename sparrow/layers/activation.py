"""Gated activations of a fused gate|up projection.

Shapes: R = rows, I = width of one half. Input x [R, 2I] holds the gate half first (columns :I), then the
up half (columns I:), the layout of transformers' fused ``gate_up_proj``; output [R, I] in x's dtype.
``act(gate) * up`` is the MLP of Llama / Mixtral / Qwen (SiLU) and Gemma (GELU-tanh).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:]; [..., 2I] -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..., :I]) * x[..., I:] (transformers' ``gelu_pytorch_tanh``); [..., 2I] -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :I]) * x[..., I:] with the exact erf GELU (transformers' ``gelu``); [..., 2I] -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu": gelu_and_mul,
}
"""HF ``hidden_act`` / ``hidden_activation`` name -> gated activation [..., 2I] -> [..., I]."""


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated activation for HF name ``name``; ValueError naming it (and the known ones) if unknown."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; sparrow knows {sorted(ACTIVATIONS)}") from None
