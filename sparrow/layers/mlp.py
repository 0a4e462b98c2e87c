"""Gated dense MLP: down(act(gate(x)) * up(x)), gate|up packed in one linear. R = rows, H = hidden,
I = intermediate. Activation names are HF's ('silu', 'gelu_pytorch_tanh'). Tensor parallel: gate_up_proj
column-parallel (this rank's I / T of the gate and of the up rows), down_proj row-parallel (one all-reduce)."""
from __future__ import annotations

import torch
from torch import nn

from sparrow.distributed import divide, tp_size
from sparrow.kernels.activation.act import ACTIVATIONS, act_and_mul
from sparrow.layers.linear import Linear
from sparrow.errors import ModelLoadError


class GatedMLP(nn.Module):
    """gate_up_proj [2I, H] (gate rows first), down_proj [H, I]; forward x [R, H] -> [R, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        divide(intermediate_size, tp_size(), "intermediate_size")
        self.gate_up_proj = Linear(hidden_size, output_sizes=[intermediate_size] * 2, bias=bias, dtype=dtype,
                                   parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, parallel="row")
        self.act_name = act

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """x [R, H] -> [R, H]; ``batch``: the step's ForwardBatch, handed to the projections."""
        return self.down_proj(act_and_mul(self.act_name, self.gate_up_proj(x, batch)), batch)

