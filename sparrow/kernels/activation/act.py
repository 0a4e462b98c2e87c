"""Gated activations of a fused gate|up projection: y = act(gate) * up.

Shapes: R = rows, I = intermediate width. x [..., 2I] = [gate | up] (the ``gate_up_proj`` output, gate
columns first), y [..., I] in x's dtype.

    silu_and_mul(x)       act = silu(g) = g * sigmoid(g)                       (Llama, Qwen, Mixtral, DeepSeek)
    gelu_tanh_and_mul(x)  act = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))  (Gemma: gelu_pytorch_tanh)
    gelu_and_mul(x)       act = exact erf GELU                                  (transformers' ``gelu``; twin only)

The torch twins (``*_ref``, the CPU path and the oracle) compute as transformers' MLPs do,
``act_fn(gate) * up`` in x's dtype: the activation rounded to x's dtype, then the product rounded again.
The Triton launchers (``*_triton``, same signature, 2-D x with unit stride on the last dim) compute
act(gate) * up in fp32 and round once (as vLLM's kernels do), so in bf16 they may differ from the twin by
a bf16 ulp. ``act_and_mul(name, x)`` dispatches by HF ``hidden_act`` name (``ACTIVATIONS``): the kernel
where ``use_triton(x)`` and one exists for the name, else the twin.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from sparrow.kernels import dispatch, pdl_kwargs, use_triton
from sparrow.kernels.common.tiles import next_pow2


# (largest I, BLOCK_I, num_warps): one program per (row, BLOCK_I outputs).
ACT_CONFIGS: tuple[tuple[int, int, int], ...] = ((512, 512, 2), (2048, 1024, 4), (1 << 62, 2048, 8))

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] as [..., I] in x's dtype (transformers' rounding).
    Raises ValueError for an odd last dim or a non-float dtype."""
    gate, up = _halves(x, "silu_and_mul")
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:] (``gelu_pytorch_tanh``) as [..., I] in x's dtype."""
    gate, up = _halves(x, "gelu_tanh_and_mul")
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> gelu(x[..., :I]) * x[..., I:] with the exact erf GELU (transformers' ``gelu``)."""
    gate, up = _halves(x, "gelu_and_mul")
    return F.gelu(gate) * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul_ref,
    "swish": silu_and_mul_ref,
    "gelu_pytorch_tanh": gelu_tanh_and_mul_ref,
    "gelu": gelu_and_mul_ref,
}
"""HF ``hidden_act`` / ``hidden_activation`` name -> the torch twin of its gated activation."""


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch twin for HF name ``name``; ValueError naming it (and the known ones) if unknown."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; sparrow knows {sorted(ACTIVATIONS)}") from None


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``silu_and_mul_ref`` (same contract)."""
    from sparrow.kernels.activation._act_jit import SILU

    return _launch(x, SILU, "silu_and_mul")


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``gelu_tanh_and_mul_ref`` (same contract)."""
    from sparrow.kernels.activation._act_jit import GELU_TANH

    return _launch(x, GELU_TANH, "gelu_tanh_and_mul")


silu_and_mul = dispatch("silu_and_mul", silu_and_mul_triton, silu_and_mul_ref, """silu(gate) * up of x [R, 2I] ->
    [R, I]; Triton by use_triton (CUDA, or forced), else the twin.""")
gelu_tanh_and_mul = dispatch("gelu_tanh_and_mul", gelu_tanh_and_mul_triton, gelu_tanh_and_mul_ref, """gelu_tanh(gate)
    * up of x [R, 2I] -> [R, I]; Triton by use_triton (CUDA, or forced), else the twin.""")


def act_and_mul(name: str, x: torch.Tensor) -> torch.Tensor:
    """act(x[..., :I]) * x[..., I:] for HF activation ``name``: the Triton kernel where ``use_triton(x)`` and
    the name has one (silu / swish / gelu_pytorch_tanh) and x is 2-D, else the twin. ValueError if unknown."""
    kernel = _TRITON_ACTS.get(name)
    if kernel is not None and x.dim() == 2 and use_triton(x):
        return kernel(x)
    return get_activation(name)(x)


def _halves(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"{name}: x must be [..., 2I] with an even last dim, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: x dtype {x.dtype} not supported (fp32, bf16, fp16)")
    return x.chunk(2, dim=-1)


def _split(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The launchers' check: a 2-D x [R, 2I] with unit stride on its last dim."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [R, 2I], got shape {tuple(x.shape)}")
    gate, up = _halves(x, name)
    if x.stride(1) != 1:
        raise ValueError(f"{name}: x must have unit stride on its last dim, got strides {x.stride()}")
    return gate, up


def _launch(x: torch.Tensor, act: int, name: str) -> torch.Tensor:
    from sparrow.kernels.activation._act_jit import act_and_mul_kernel

    _split(x, name)
    rows, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0 or inter == 0:
        return y
    _, block, num_warps = next(c for c in ACT_CONFIGS if inter <= c[0])
    block = min(block, next_pow2(inter))
    grid = (rows, -(-inter // block))
    act_and_mul_kernel[grid](x, y, inter, x.stride(0), ACT=act, BLOCK_I=block, num_warps=num_warps, **pdl_kwargs(x))
    return y


_TRITON_ACTS = {"silu": silu_and_mul_triton, "swish": silu_and_mul_triton,
                "gelu_pytorch_tanh": gelu_tanh_and_mul_triton}
