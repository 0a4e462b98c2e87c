"""Triton bodies of the LoRA kernels (launchers and torch twins: sparrow/kernels/lora.py).

Shapes: P = rows (or (row, expert) pairs), K = in features, N = out features, L = weight sets (slots, or
slots x experts), R = rank width of the buffers. One program per row (and N tile): ``_lookup`` finds the row's
weight set (v = slots[p // SLOT_DIV]; with expert ids v x NUM_E + expert_ids[p]) and its slot's rank; rows of
slot < 0 do nothing (or store zeros when not accumulating); columns past the slot's rank are masked (not read).
"""
import triton
import triton.language as tl

from sparrow.kernels._pdl_jit import pdl_enter


@triton.jit
def _lookup(slot_ptr, eid_ptr, rank_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS: tl.constexpr):
    """(weight set, rank, valid) of row p."""
    v = tl.load(slot_ptr + p // SLOT_DIV).to(tl.int64)
    valid = v >= 0
    safe = tl.maximum(v, 0)
    if HAS_EIDS:
        idx = safe * NUM_E + tl.load(eid_ptr + p).to(tl.int64)
        rank = tl.load(rank_ptr + safe)
    else:
        idx = safe
        rank = tl.load(rank_ptr + safe // RANK_DIV)
    return idx, rank, valid


@triton.jit
def _shrink_row(x_ptr, a_ptr, row, idx, rank, K, R, stride_x, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """t [BLOCK_R] fp32 = A[idx][:rank] @ x[row] (zeros past rank)."""
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        x = tl.load(x_ptr + row * stride_x + kk, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + idx * R * K + rr[:, None] * K + kk[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    return acc


@triton.jit
def _expand_tile(t, b_ptr, out_ptr, p, idx, rank, valid, pid_n, N, R,
                 ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[p, tile] (+)= B[idx][tile, :rank] @ t; a row of slot < 0: untouched (ACCUMULATE) or zeros."""
    rr = tl.arange(0, BLOCK_R)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    ptrs = out_ptr + p.to(tl.int64) * N + nn
    if valid:
        b = tl.load(b_ptr + idx * N * R + nn[:, None] * R + rr[None, :],
                    mask=n_mask[:, None] & (rr < rank)[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * t[None, :], axis=1)
        if ACCUMULATE:
            delta += tl.load(ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(ptrs, delta.to(out_ptr.dtype.element_ty), mask=n_mask)
    elif not ACCUMULATE:
        tl.store(ptrs, tl.zeros([BLOCK_N], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [rows of x, K], unit last stride
    a_ptr,  # [L, R, K] contiguous
    slot_ptr,  # [P // SLOT_DIV] int: slot of each row (< 0: none), or the weight set itself without expert ids
    eid_ptr,  # HAS_EIDS: [P] int expert of each pair; else dummy
    rank_ptr,  # [slots] int32: used rank of each slot
    t_ptr,  # [P, R] fp32 out (rows of slot < 0 not written)
    K, R, X_DIV, SLOT_DIV, NUM_E, RANK_DIV, stride_x,
    HAS_EIDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    idx, rank, valid = _lookup(slot_ptr, eid_ptr, rank_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS)
    if valid:
        t = _shrink_row(x_ptr, a_ptr, (p // X_DIV).to(tl.int64), idx, rank, K, R, stride_x, BLOCK_R, BLOCK_K)
        rr = tl.arange(0, BLOCK_R)
        tl.store(t_ptr + p.to(tl.int64) * R + rr, t, mask=rr < R)


@triton.jit
def lora_expand_kernel(
    t_ptr,  # [P, R] fp32 (lora_shrink_kernel's output)
    b_ptr,  # [L, N, R] contiguous
    slot_ptr, eid_ptr, rank_ptr,  # as lora_shrink_kernel
    out_ptr,  # [P, N] contiguous
    N, R, SLOT_DIV, NUM_E, RANK_DIV,
    HAS_EIDS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    idx, rank, valid = _lookup(slot_ptr, eid_ptr, rank_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS)
    rr = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + p.to(tl.int64) * R + rr, mask=(rr < rank) & (rr < R), other=0.0)  # unused if not valid
    _expand_tile(t, b_ptr, out_ptr, p, idx, rank, valid, pid_n, N, R, ACCUMULATE, BLOCK_R, BLOCK_N)


@triton.jit
def lora_fused_kernel(
    x_ptr, a_ptr, b_ptr, slot_ptr, eid_ptr, rank_ptr, out_ptr,  # as the two kernels above
    K, N, R, X_DIV, SLOT_DIV, NUM_E, RANK_DIV, stride_x,
    HAS_EIDS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Shrink and expand in one launch: each (row, N tile) program computes its row's t itself (few rows)."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    idx, rank, valid = _lookup(slot_ptr, eid_ptr, rank_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS)
    t = tl.zeros([BLOCK_R], dtype=tl.float32)
    if valid:
        t = _shrink_row(x_ptr, a_ptr, (p // X_DIV).to(tl.int64), idx, rank, K, R, stride_x, BLOCK_R, BLOCK_K)
    _expand_tile(t, b_ptr, out_ptr, p, idx, rank, valid, pid_n, N, R, ACCUMULATE, BLOCK_R, BLOCK_N)
