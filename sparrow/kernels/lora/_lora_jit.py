"""Triton bodies of the LoRA kernels (launchers and torch twins: sparrow/kernels/lora/lora.py).

Shapes: P = rows (or (row, expert) pairs), K = in features, N = out features, L = weight sets (slots, or
slots x experts), R = rank width of the buffers, S = K chunks of the shrink, G = output segments of B (the
shards of a packed projection, <= 3). ``_lookup`` finds a row's weight set (v = slots[p // SLOT_DIV]; with
expert ids v x NUM_E + expert_ids[p]) and its slot; rows of slot < 0 do nothing (or store zeros when not
accumulating); A rows past the slot's rank and B rank rows outside a segment's columns are masked (not read).

The shrink is split over K: program (p, s) writes the partial product of K chunk s into t [P, S, R]; the expand's
programs (p, N tile) sum row p's S partials themselves (no atomics, no zeroed workspace: the sum's order is
fixed, so the result does not depend on scheduling). B is stored rank-major [L, R, N]: an expand program reads
its segment's rank rows, each a contiguous run of BLOCK_N outputs.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._pdl_jit import pdl_enter


@triton.jit
def _lookup(slot_ptr, eid_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS: tl.constexpr):
    """(weight set, slot, valid) of row p."""
    v = tl.load(slot_ptr + p // SLOT_DIV).to(tl.int64)
    valid = v >= 0
    safe = tl.maximum(v, 0)
    if HAS_EIDS:
        idx = safe * NUM_E + tl.load(eid_ptr + p).to(tl.int64)
        slot = safe
    else:
        idx = safe
        slot = safe // RANK_DIV
    return idx, slot, valid


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [rows of x, K], unit last stride
    a_ptr,  # [L, R, K] contiguous
    slot_ptr,  # [P // SLOT_DIV] int: slot of each row (< 0: none), or the weight set itself without expert ids
    eid_ptr,  # HAS_EIDS: [P] int expert of each pair; else dummy
    rank_ptr,  # [slots] int32: used rank of each slot
    t_ptr,  # [P, S, R] fp32 out: t[p, s] = A[w(p)][:, chunk s] @ x[p // X_DIV][chunk s] (rows of slot < 0 unwritten)
    K, R, S, CHUNK, X_DIV, SLOT_DIV, NUM_E, RANK_DIV, stride_x,
    HAS_EIDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program (p, s): K columns [s CHUNK, (s + 1) CHUNK) of row p, BLOCK_K at a time."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    s = tl.program_id(1)
    idx, slot, valid = _lookup(slot_ptr, eid_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS)
    if valid:
        rank = tl.load(rank_ptr + slot)
        row = (p // X_DIV).to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        r_mask = rr < rank
        k_lo = s * CHUNK
        k_hi = tl.minimum(k_lo + CHUNK, K)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < k_hi
            x = tl.load(x_ptr + row * stride_x + kk, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + idx * R * K + rr[:, None] * K + kk[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(t_ptr + (p.to(tl.int64) * S + s) * R + rr, acc, mask=rr < R)


@triton.jit
def lora_expand_kernel(
    t_ptr,  # [P, S, R] fp32 (lora_shrink_kernel's partials; S = 1: a whole t)
    b_ptr,  # [L, R, N] contiguous (rank-major)
    slot_ptr, eid_ptr, rank_ptr,  # as lora_shrink_kernel
    seg_ptr,  # HAS_SEGS: [slots, G, 2] int32 (first rank row, rank rows) of each output segment; else dummy
    out_ptr,  # [P, N] contiguous
    N, R, S, G, N0, N1, SLOT_DIV, NUM_E, RANK_DIV,
    HAS_EIDS: tl.constexpr, HAS_SEGS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program (p, j): the j-th BLOCK_N tile of the segments [0, N0), [N0, N0 + N1), [N0 + N1, N) taken in order
    (tiles never straddle a segment); out[p, tile] (+)= B[w(p)][c:c + m, tile]^T @ sum_s t[p, s, c:c + m] with
    (c, m) the segment's rank rows of row p's slot (without HAS_SEGS: (0, rank)), BLOCK_R rank rows at a time; a
    row of slot < 0: untouched (ACCUMULATE) or zeros."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    pid = tl.program_id(1)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    g = (pid >= t0).to(tl.int32) + (pid >= t0 + t1).to(tl.int32)
    n_lo = tl.where(g == 0, 0, tl.where(g == 1, N0, N0 + N1))
    n_hi = tl.where(g == 0, N0, tl.where(g == 1, N0 + N1, N))
    first = tl.where(g == 0, 0, tl.where(g == 1, t0, t0 + t1))
    nn = n_lo + (pid - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < n_hi
    ptrs = out_ptr + p.to(tl.int64) * N + nn
    idx, slot, valid = _lookup(slot_ptr, eid_ptr, p, SLOT_DIV, NUM_E, RANK_DIV, HAS_EIDS)
    if valid:
        if HAS_SEGS:
            c = tl.load(seg_ptr + (slot * G + g) * 2)
            m = tl.load(seg_ptr + (slot * G + g) * 2 + 1)
        else:
            c = 0
            m = tl.load(rank_ptr + slot)
        ss = tl.arange(0, BLOCK_S)
        t_row = t_ptr + p.to(tl.int64) * S * R
        b_set = b_ptr + idx * R * N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j0 in range(0, m, BLOCK_R):
            rr = j0 + tl.arange(0, BLOCK_R)
            r_mask = rr < m
            parts = tl.load(t_row + ss[:, None] * R + c + rr[None, :], mask=(ss < S)[:, None] & r_mask[None, :],
                            other=0.0)
            t = tl.sum(parts, axis=0)
            b = tl.load(b_set + (c + rr)[:, None].to(tl.int64) * N + nn[None, :],
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * t[:, None], axis=0)
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    elif not ACCUMULATE:
        tl.store(ptrs, tl.zeros([BLOCK_N], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=n_mask)
