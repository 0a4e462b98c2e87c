"""LoRA shrink / expand for rows of many adapters in one step (Punica / S-LoRA's SGMV idea, per row):

    t[p]    = A[idx[p]] @ x[p // row_div]            (shrink, fp32)       A [L, R, K], x [X, K] -> t [P, R]
    out[p] += B[idx[p]] @ t[p]                        (expand, in place)   B [L, N, R], out [P, N]

Shapes: P = rows (or (row, expert) pairs: ``row_div`` = top-k maps pair p to its row), K = in features,
N = out features, L = weight sets (adapter slots, or slots x experts), R = the buffers' rank width (zero-padded
past each slot's rank). ``idx`` [P] int: the weight set of each row, < 0 for rows without an adapter (left
untouched). ``ranks`` [L // rank_div] int32: the rank each slot uses (the kernels skip the zero padding past it;
the twins read it whole: zeros add nothing). The LoRA scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) is
folded into B by the caller. fp32 accumulation; ``out`` gets y + delta rounded once to its dtype.

The Triton kernels (``_lora_jit``) run where ``use_triton(x)``; no launch synchronizes with the host (CUDA graph
safe); the torch twins (one matmul per distinct weight set in ``idx``, a host sync) are the CPU path and the
oracle. Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import torch

from sparrow.kernels import use_triton


def _check(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor, name: str) -> None:
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"{name}: weights must be a contiguous [L, *, *] tensor, got {tuple(w.shape)}")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: idx must be a [P] int32 / int64 tensor, got {tuple(idx.shape)} {idx.dtype}")
    if ranks.dtype != torch.int32:
        raise ValueError(f"{name}: ranks must be int32, got {ranks.dtype}")
    for n, t in (("weights", w), ("idx", idx), ("ranks", ranks)):
        if t.device != x.device:
            raise ValueError(f"{name}: {n} is on {t.device}, the input on {x.device}")


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor, row_div: int = 1,
                    rank_div: int = 1) -> torch.Tensor:
    """Torch twin of ``lora_shrink``: t [P, R] fp32 (rows with idx < 0: zeros)."""
    t = torch.zeros(idx.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for i in torch.unique(idx[idx >= 0]).tolist():
        pairs = (idx == i).nonzero().squeeze(1)
        t[pairs] = x[pairs // row_div].float() @ a[i].float().t()
    return t


def lora_expand_ref(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor, out: torch.Tensor,
                    rank_div: int = 1) -> torch.Tensor:
    """Torch twin of ``lora_expand``: out[p] += B[idx[p]] @ t[p] in place; returns out."""
    for i in torch.unique(idx[idx >= 0]).tolist():
        pairs = (idx == i).nonzero().squeeze(1)
        out[pairs] = (out[pairs].float() + t[pairs] @ b[i].float().t()).to(out.dtype)
    return out


def _block(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def lora_shrink_triton(x, a, idx, ranks, row_div=1, rank_div=1):
    """Triton launcher of ``lora_shrink``: one program per row (rows with idx < 0 leave t's row unwritten)."""
    from sparrow.kernels._lora_jit import lora_shrink_kernel

    _check(x, a, idx, ranks, "lora_shrink")
    if x.stride(-1) != 1:
        x = x.contiguous()
    p, (_, r, k) = idx.shape[0], a.shape
    t = torch.empty(p, r, dtype=torch.float32, device=x.device)
    if p:
        lora_shrink_kernel[(p,)](x, a, idx, ranks, t, k, r, row_div, rank_div, x.stride(0),
                                 BLOCK_R=_block(r), BLOCK_K=128 if r <= 32 else 64, num_warps=4)
    return t


def lora_expand_triton(t, b, idx, ranks, out, rank_div=1):
    """Triton launcher of ``lora_expand``: one program per (row, 64 outputs); out must be contiguous [P, N]."""
    from sparrow.kernels._lora_jit import lora_expand_kernel

    _check(t, b, idx, ranks, "lora_expand")
    if not out.is_contiguous() or out.shape[0] != idx.shape[0] or out.shape[1] != b.shape[1]:
        raise ValueError(f"lora_expand: out must be a contiguous [P={idx.shape[0]}, N={b.shape[1]}], "
                         f"got {tuple(out.shape)}")
    p, (_, n, r) = idx.shape[0], b.shape
    block_n = 64
    if p:
        lora_expand_kernel[(p, -(-n // block_n))](t, b, idx, ranks, out, n, r, rank_div,
                                                 BLOCK_R=_block(r), BLOCK_N=block_n, num_warps=4)
    return out


def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor, row_div: int = 1,
                rank_div: int = 1) -> torch.Tensor:
    """t [P, R] fp32 = A[idx[p]] @ x[p // row_div] (see the module doc); rows with idx < 0 are unspecified."""
    fn = lora_shrink_triton if use_triton(x) else lora_shrink_ref
    return fn(x, a, idx, ranks, row_div, rank_div)


def lora_expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor, out: torch.Tensor,
                rank_div: int = 1) -> torch.Tensor:
    """out[p] += B[idx[p]] @ t[p] in place for rows with idx >= 0; returns out."""
    fn = lora_expand_triton if use_triton(out) else lora_expand_ref
    return fn(t, b, idx, ranks, out, rank_div)
