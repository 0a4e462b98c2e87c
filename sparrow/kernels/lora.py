"""LoRA deltas for rows of many adapters in one step (Punica / S-LoRA's shrink / expand, one row per program):

    t[p]    = A[w(p)] @ x[p // x_div]              (shrink, fp32)      A [L, R, K], x [X, K] -> t [P, R]
    out[p]  (+)= B[w(p)] @ t[p]                     (expand)            B [L, N, R], out [P, N]
    lora_delta = both: a split-K shrink (grid P x ceil(K / SPLIT_K_CHUNK) up to SPLIT_K_MAX_ROWS rows, each
                 program one K chunk's partial t, no atomics), then the expand summing the partials

Shapes: P = rows (or (row, expert) pairs), K = in features, N = out features, L = weight sets (adapter slots, or
slots x experts), R = the buffers' rank width (zero-padded past each slot's rank). The weight set of row p:
v = slots[p // slot_div]; with ``expert_ids`` [P] (routed experts: pair p of row p // top-k) w(p) = v x
num_experts + expert_ids[p], the slot v; without, w(p) = v, the slot v // rank_div. Rows with v < 0 (the base
model) are left untouched, or get zeros with ``accumulate=False``. ``ranks`` [slots] int32: the rank each slot
uses (the kernels read no column past it; the twins read the zero padding: it adds nothing). The LoRA scaling is
folded into B by the caller. fp32 accumulation; out gets (out +) delta rounded once to its dtype. P is
expert_ids' length, else slots' length.

Triton kernels (``_lora_jit``) where ``use_triton(x)``: no launch synchronizes with the host (CUDA graph safe);
PDL launches on Hopper. The torch twins (one matmul per distinct weight set, a host sync) are the CPU path and the
oracle. Tile choices are untuned defaults. Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import torch

from sparrow.kernels import pdl_kwargs, use_triton

SPLIT_K_CHUNK = 256
"""K columns per shrink program of lora_delta at up to SPLIT_K_MAX_ROWS rows (decode, verify, routed pairs)."""
SPLIT_K_MAX_ROWS = 256
"""Above this many rows the grid is full with one shrink program per row (over all of K: no partials to keep)."""
SHRINK_TILE = 8192
"""Elements of A a shrink program loads at once (BLOCK_R x BLOCK_K)."""
EXPAND_BLOCK_N = 64


def lora_index(slots: torch.Tensor, expert_ids: torch.Tensor | None = None, num_experts: int = 1,
               slot_div: int = 1) -> torch.Tensor:
    """[P] int64 weight set of each row (module doc), -1 for rows without an adapter (torch)."""
    if expert_ids is None:
        return slots.to(torch.int64)
    flat = expert_ids.reshape(-1).to(torch.int64)
    v = slots.to(torch.int64).repeat_interleave(slot_div)[: flat.numel()]
    return torch.where(v >= 0, v * num_experts + flat, -1)


def _check(x, w, slots, ranks, expert_ids, name) -> None:
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"{name}: weights must be a contiguous [L, *, *] tensor, got {tuple(w.shape)}")
    for n, t in (("slots", slots), ("expert_ids", expert_ids)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {n} must be int32 / int64, got {t.dtype}")
    if ranks.dtype != torch.int32:
        raise ValueError(f"{name}: ranks must be int32, got {ranks.dtype}")
    for n, t in (("weights", w), ("slots", slots), ("ranks", ranks), ("expert_ids", expert_ids)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {n} is on {t.device}, the input on {x.device}")


def _rows(slots, expert_ids) -> int:
    return expert_ids.numel() if expert_ids is not None else slots.numel()


# ------------------------------------------------------------------------------------------------ twins


def lora_shrink_ref(x, a, slots, ranks, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1):
    """Torch twin of ``lora_shrink``: t [P, R] fp32 (rows without an adapter: zeros)."""
    idx = lora_index(slots, expert_ids, num_experts, slot_div)
    t = torch.zeros(idx.numel(), a.shape[1], dtype=torch.float32, device=x.device)
    for i in torch.unique(idx[idx >= 0]).tolist():
        rows = (idx == i).nonzero().squeeze(1)
        t[rows] = x[rows // x_div].float() @ a[i].float().t()
    return t


def lora_expand_ref(t, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, rank_div=1,
                    accumulate=True):
    """Torch twin of ``lora_expand``: out[p] (+)= B[w(p)] @ t[p] in place; returns out."""
    idx = lora_index(slots, expert_ids, num_experts, slot_div)
    if not accumulate:
        out[idx < 0] = 0
    for i in torch.unique(idx[idx >= 0]).tolist():
        rows = (idx == i).nonzero().squeeze(1)
        base = out[rows].float() if accumulate else 0.0
        out[rows] = (base + t[rows] @ b[i].float().t()).to(out.dtype)
    return out


def lora_delta_ref(x, a, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1,
                   accumulate=True):
    """Torch twin of ``lora_delta``."""
    t = lora_shrink_ref(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div)
    return lora_expand_ref(t, b, slots, ranks, out, expert_ids, num_experts, slot_div, rank_div, accumulate)


# ------------------------------------------------------------------------------------------- launchers


def _block(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _common(x, slots, ranks, expert_ids, num_experts, slot_div, rank_div):
    has = expert_ids is not None
    eids = expert_ids.reshape(-1) if has else slots
    return (slots, eids, ranks), dict(SLOT_DIV=slot_div, NUM_E=num_experts, RANK_DIV=rank_div), dict(HAS_EIDS=has)


def shrink_chunk(p: int, k: int) -> int:
    """K columns per shrink program of lora_delta at P rows (the dispatch rule, module doc)."""
    return SPLIT_K_CHUNK if p <= SPLIT_K_MAX_ROWS else max(k, 1)


def _shrink_parts(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div, chunk, name):
    """t [P, S, R] fp32 partial products of the S = ceil(K / chunk) K chunks (rows without an adapter unwritten)."""
    from sparrow.kernels._lora_jit import lora_shrink_kernel

    _check(x, a, slots, ranks, expert_ids, name)
    x = x if x.stride(-1) == 1 else x.contiguous()
    p, (_, r, k) = _rows(slots, expert_ids), a.shape
    splits = max(1, -(-k // chunk))
    t = torch.empty(p, splits, r, dtype=torch.float32, device=x.device)
    if p:
        ptrs, divs, flags = _common(x, slots, ranks, expert_ids, num_experts, slot_div, rank_div)
        block_r = _block(r)
        block_k = max(16, min(_block(chunk), SHRINK_TILE // block_r))
        lora_shrink_kernel[(p, splits)](
            x, a, *ptrs, t, k, r, splits, chunk, x_div, divs["SLOT_DIV"], divs["NUM_E"], divs["RANK_DIV"],
            x.stride(0), **flags, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4, **pdl_kwargs(x))
    return t


def lora_shrink_triton(x, a, slots, ranks, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1):
    """Triton launcher of ``lora_shrink``: one program per row over all of K (rows without an adapter: t's row
    unwritten)."""
    k = a.shape[2] if a.dim() == 3 else 1
    t = _shrink_parts(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div, max(k, 1),
                      "lora_shrink")
    return t.view(t.shape[0], t.shape[2])


def lora_expand_triton(t, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, rank_div=1,
                       accumulate=True):
    """Triton launcher of ``lora_expand``: one program per (row, EXPAND_BLOCK_N outputs); t [P, R] or the shrink's
    partials [P, S, R] (summed), fp32 contiguous; out must be contiguous [P, N]."""
    from sparrow.kernels._lora_jit import lora_expand_kernel

    _check(t, b, slots, ranks, expert_ids, "lora_expand")
    p, (_, n, r) = _rows(slots, expert_ids), b.shape
    _check_out(out, p, n, "lora_expand")
    parts = t if t.dim() == 3 else t.unsqueeze(1)
    if parts.dtype != torch.float32 or not parts.is_contiguous() or parts.shape[0] != p or parts.shape[2] != r:
        raise ValueError(f"lora_expand: t must be a contiguous fp32 [P={p}, R={r}] or [P, S, R] tensor, got "
                         f"{t.dtype} {tuple(t.shape)}")
    if p:
        ptrs, divs, flags = _common(t, slots, ranks, expert_ids, num_experts, slot_div, rank_div)
        splits = parts.shape[1]
        lora_expand_kernel[(p, -(-n // EXPAND_BLOCK_N))](
            parts, b, *ptrs, out, n, r, splits, divs["SLOT_DIV"], divs["NUM_E"], divs["RANK_DIV"], **flags,
            ACCUMULATE=accumulate, BLOCK_R=_block(r), BLOCK_S=_block(splits, 1), BLOCK_N=EXPAND_BLOCK_N,
            num_warps=4, **pdl_kwargs(t))
    return out


def lora_delta_triton(x, a, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1,
                      accumulate=True):
    """Triton launcher of ``lora_delta``: the split-K shrink (``shrink_chunk``), then the expand summing its
    partials."""
    _check(x, a, slots, ranks, expert_ids, "lora_delta")
    p, (_, n, _), k = _rows(slots, expert_ids), b.shape, a.shape[2]
    _check_out(out, p, n, "lora_delta")
    t = _shrink_parts(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div, shrink_chunk(p, k),
                      "lora_delta")
    return lora_expand_triton(t, b, slots, ranks, out, expert_ids, num_experts, slot_div, rank_div, accumulate)


def _check_out(out, p, n, name) -> None:
    if not out.is_contiguous() or tuple(out.shape) != (p, n):
        raise ValueError(f"{name}: out must be a contiguous [P={p}, N={n}] tensor, got {tuple(out.shape)}")


# ----------------------------------------------------------------------------------------- dispatchers


def lora_shrink(x, a, slots, ranks, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1):
    """t [P, R] fp32 = A[w(p)] @ x[p // x_div] (module doc); rows without an adapter are unspecified."""
    fn = lora_shrink_triton if use_triton(x) else lora_shrink_ref
    return fn(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div)


def lora_expand(t, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, rank_div=1, accumulate=True):
    """out[p] (+)= B[w(p)] @ t[p] in place (module doc); returns out."""
    fn = lora_expand_triton if use_triton(out) else lora_expand_ref
    return fn(t, b, slots, ranks, out, expert_ids, num_experts, slot_div, rank_div, accumulate)


def lora_delta(x, a, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1,
               accumulate=True):
    """out[p] (+)= B[w(p)] @ (A[w(p)] @ x[p // x_div]) in place (module doc); returns out."""
    fn = lora_delta_triton if use_triton(x) else lora_delta_ref
    return fn(x, a, b, slots, ranks, out, expert_ids, num_experts, slot_div, x_div, rank_div, accumulate)
