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
The Triton path (``int4_fused_moe_triton``): the small path is a per-(pair, N tile) W4A16 kernel (weights
dequantized in registers, fp32 accumulation, activation fused into gate|up) and ``moe_reduce``; the grouped
path dequantizes the experts to x's dtype (one Triton pass) and runs the float grouped GEMM.
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
                       activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """The torch twin of ``int4_fused_moe`` (module doc)."""
    used = torch.unique(topk_ids.reshape(-1))
    gate_up = dequantize_experts(w13, w13_scale, w13_zero, group, x.dtype, used)
    down = dequantize_experts(w2, w2_scale, w2_zero, group, x.dtype, used)
    path = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
    return path(x, gate_up, down, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce, lora=lora)


def int4_fused_moe(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                   activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """Routed int4 experts; see the module doc. Triton (``int4_fused_moe_triton``) where ``use_triton(x)``.
    ``lora``: per-pair adapter deltas (``sparrow.kernels.moe.fused_moe``'s); on Triton they take the
    dequantize + grouped GEMM path at every size."""
    from sparrow.kernels import use_triton

    fn = int4_fused_moe_triton if use_triton(x) else int4_fused_moe_ref
    return fn(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                              activation, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit, reduce=reduce,
              lora=lora)


SMALL_BLOCK_N = 32
SMALL_BLOCK_K = 128
"""Tile of the per-pair kernel (untuned default)."""
DEQUANT_BLOCK = (32, 128)
_ACT_CODE = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def dequantize_experts_triton(w, scale, zero, group, dtype):
    """Triton twin of ``dequantize_experts`` (all experts): [E, N, K / 8] -> [E, N, K] in ``dtype``."""
    from sparrow.kernels import interpreting
    from sparrow.kernels._int4_jit import int4_dequant_kernel
    from sparrow.kernels.int4 import w_round

    e, n, words = w.shape
    k = words * 8
    out = torch.empty(e, n, k, dtype=dtype, device=w.device)
    bn, bk = DEQUANT_BLOCK
    grid = (-(-(e * n) // bn), -(-k // bk))
    int4_dequant_kernel[grid](w, scale, zero if zero is not None else scale, out, e * n, k, words, scale.shape[-1],
                              group, HAS_ZERO=zero is not None, W_ROUND=w_round(scale.dtype, dtype),
                              RNE=interpreting(), BLOCK_N=bn, BLOCK_K=bk)
    return out


def int4_fused_moe_triton(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                          activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """Triton launcher of ``int4_fused_moe``: P <= pair_threshold (and <= moe.SMALL_MAX_PAIRS): the per-pair W4A16
    kernel (gate|up + activation, then down; each pair reads its expert's int4 rows once) and ``moe_reduce``;
    more pairs: the experts dequantized to x's dtype by a Triton kernel, then the float grouped GEMM
    (``moe.fused_moe_triton``). Weights must be contiguous."""
    from sparrow.kernels import interpreting
    from sparrow.kernels._int4_jit import int4_moe_pair_kernel
    from sparrow.kernels.int4 import w_round
    from sparrow.kernels.moe import SMALL_MAX_PAIRS, fused_moe_triton
    from sparrow.kernels.moe_reduce import moe_reduce

    rows, hidden = x.shape
    pairs = topk_ids.numel()
    width = w13.shape[1] // 2
    if pairs > min(pair_threshold, SMALL_MAX_PAIRS) or lora is not None:
        deq = lambda w, s, z: dequantize_experts_triton(w, s, z, group, x.dtype)  # noqa: E731
        return fused_moe_triton(x, deq(w13, w13_scale, w13_zero), deq(w2, w2_scale, w2_zero), topk_weights,
                                topk_ids, activation, pair_threshold=-1, swiglu_limit=swiglu_limit, reduce=reduce,
                                lora=lora)
    if rows == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(0, hidden)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    interp = interpreting()
    for a, div, w, s, z, out, n, k, gated in ((x, topk_ids.shape[1], w13, w13_scale, w13_zero, act, width, hidden, True),
                                              (act, 1, w2, w2_scale, w2_zero, y, hidden, width, False)):
        int4_moe_pair_kernel[(pairs, -(-n // SMALL_BLOCK_N))](
            a, w, s, z if z is not None else s, out, ids, n, k, div, a.stride(0), w.stride(0), w.stride(1),
            s.stride(0), s.stride(1), group, float(swiglu_limit) if swiglu_limit is not None else 0.0,
            GATED=gated, ACT=_ACT_CODE[activation], HAS_LIMIT=swiglu_limit is not None, HAS_ZERO=z is not None,
            W_ROUND=w_round(s.dtype, x.dtype), RNE=interp, RNE_OUT=interp and x.dtype == torch.bfloat16,
            BLOCK_N=SMALL_BLOCK_N, BLOCK_K=SMALL_BLOCK_K)
    return moe_reduce(y, topk_weights, x.dtype) if reduce else y
