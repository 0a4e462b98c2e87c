"""MoE reduce: the per-pair expert outputs back to row order, weighted by the router and summed over K
(the last step of both paths of ``sparrow.kernels.moe.moe.fused_moe``).

Shapes: R = rows, K = top-k, H = hidden, P = R * K pairs (pair p = row p // K, slot p % K).
``moe_reduce_ref`` is the torch twin, ``moe_reduce_triton`` the launcher, ``moe_reduce`` the dispatcher.
The sum is fp32 with one final rounding. Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import torch

from sparrow.kernels import dispatch, interpreting as _interpret, pdl_kwargs
from sparrow.kernels.common.tiles import next_pow2


def moe_reduce_ref(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """Unpermute + weighted reduce: y [P, H] (pair order), topk_weights [R, K] -> [R, H] in ``out_dtype``
    (default y's): sum_k w[r, k] y[r K + k] in fp32, rounded once."""
    rows, top_k = _check_reduce(y, topk_weights)
    out = (y.float().view(rows, top_k, -1) * topk_weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(out_dtype or y.dtype)


def moe_reduce_triton(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
    """Triton launcher of ``moe_reduce_ref`` (same contract); one program per (row, BLOCK_H columns)."""
    from sparrow.kernels.moe._moe_jit import moe_reduce_kernel

    rows, top_k = _check_reduce(y, topk_weights)
    hidden = y.shape[1]
    out = torch.empty(rows, hidden, dtype=out_dtype or y.dtype, device=y.device)
    if rows == 0 or hidden == 0:
        return out
    y = y.contiguous()
    w = topk_weights if topk_weights.stride(-1) == 1 else topk_weights.contiguous()
    block_h = min(1024, next_pow2(hidden))
    moe_reduce_kernel[(rows, -(-hidden // block_h))](
        y, w, out, hidden, w.stride(0),
        TOPK=top_k, RNE_BF16=_interpret() and out.dtype == torch.bfloat16, BLOCK_H=block_h,
        num_warps=4, **pdl_kwargs(y),
    )
    return out


moe_reduce = dispatch("moe_reduce", moe_reduce_triton, moe_reduce_ref,
                      """``moe_reduce_ref``'s contract: Triton where ``use_triton(y)``, else the twin.""")


def _check_reduce(y, topk_weights) -> tuple[int, int]:
    if topk_weights.dim() != 2 or y.dim() != 2 or y.shape[0] != topk_weights.numel():
        raise ValueError(f"moe_reduce: need y [P, H] and topk_weights [R, K] with P = R * K, got "
                         f"{tuple(y.shape)} and {tuple(topk_weights.shape)}")
    return topk_weights.shape
