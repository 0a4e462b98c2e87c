"""int4 W4A16 routed experts: the torch twin and the dispatcher.

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K pairs, G1 = ceil(H / group),
G2 = ceil(I / group).

    int4_fused_moe(x [R, H], w13 int32 [E, 2I, H / 8], w13_scale [E, 2I, G1], w13_zero uint8 [E, 2I, G1] | None,
                   w2 int32 [E, H, I / 8], w2_scale [E, H, G2], w2_zero | None, group, topk_weights [R, K],
                   topk_ids [R, K], activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True)
        -> [R, H] in x's dtype (or the unweighted per-pair outputs [P, H] with reduce=False)

The weights are ``sparrow.kernels.int4``'s layout. The twin ``int4_fused_moe_ref`` dequantizes the selected
experts to x's dtype (``dequantize_int4_ref``) and runs the float twins of ``moe_ref`` (grouped for
P > pair_threshold, per pair otherwise), so its numbers are the float experts' on the dequantized weights.
"""
from __future__ import annotations

import torch

from sparrow.kernels.int4 import dequantize_int4_ref
from sparrow.kernels.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                       dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked int4 experts [E, N, K / 8] -> [E, N, K] in ``dtype``; only the experts listed in ``experts`` are
    dequantized (the others left zero) when it is given."""
    if experts is None:
        return dequantize_int4_ref(w, scale, zero, group).to(dtype)
    out = torch.zeros(w.shape[0], w.shape[1], w.shape[2] * 8, dtype=dtype, device=w.device)
    out[experts] = dequantize_int4_ref(w[experts], scale[experts], None if zero is None else zero[experts],
                                       group).to(dtype)
    return out


def int4_fused_moe_ref(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                       activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True):
    """The torch twin of ``int4_fused_moe`` (module doc)."""
    used = torch.unique(topk_ids.reshape(-1))
    gate_up = dequantize_experts(w13, w13_scale, w13_zero, group, x.dtype, used)
    down = dequantize_experts(w2, w2_scale, w2_zero, group, x.dtype, used)
    path = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
    return path(x, gate_up, down, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce)


def int4_fused_moe(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                   activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True):
    """Routed int4 experts; see the module doc."""
    return int4_fused_moe_ref(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                              activation, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit, reduce=reduce)
