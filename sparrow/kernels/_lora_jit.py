"""Triton bodies of the LoRA shrink / expand kernels (launchers and torch twins: sparrow/kernels/lora.py).

Shapes: P = rows (or (row, expert) pairs), K = in features, N = out features, L = adapter weight sets (slots, or
slots x experts), R = rank width of the buffers. One program per (row, tile): the row's adapter index selects the
weight set, rows without an adapter (index < 0) do nothing; columns past the slot's rank are masked (not read).
"""
import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [rows of x, K], unit last stride
    a_ptr,  # [L, R, K] contiguous
    idx_ptr,  # [P] int: weight set of pair p (< 0: none)
    rank_ptr,  # [L // RANK_DIV] int32: used rank of each slot
    t_ptr,  # [P, R] fp32 out
    K, R, ROW_DIV, RANK_DIV, stride_x,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    p = tl.program_id(0)
    idx = tl.load(idx_ptr + p).to(tl.int64)
    if idx >= 0:
        rank = tl.load(rank_ptr + idx // RANK_DIV)
        rr = tl.arange(0, BLOCK_R)
        r_mask = rr < rank
        row = (p // ROW_DIV).to(tl.int64)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            x = tl.load(x_ptr + row * stride_x + kk, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + idx * R * K + rr[:, None] * K + kk[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(t_ptr + p * R + rr, acc, mask=rr < R)


@triton.jit
def lora_expand_kernel(
    t_ptr,  # [P, R] fp32 (lora_shrink_kernel's output)
    b_ptr,  # [L, N, R] contiguous
    idx_ptr,  # [P] int
    rank_ptr,  # [L // RANK_DIV] int32
    out_ptr,  # [P, N] contiguous; out[p] += B[idx[p]] @ t[p] (rows with idx < 0 untouched)
    N, R, RANK_DIV,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    idx = tl.load(idx_ptr + p).to(tl.int64)
    if idx >= 0:
        rank = tl.load(rank_ptr + idx // RANK_DIV)
        rr = tl.arange(0, BLOCK_R)
        r_mask = rr < rank
        nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = nn < N
        t = tl.load(t_ptr + p * R + rr, mask=r_mask, other=0.0)
        b = tl.load(b_ptr + idx * N * R + nn[:, None] * R + rr[None, :],
                    mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * t[None, :], axis=1)
        ptrs = out_ptr + p.to(tl.int64) * N + nn
        y = tl.load(ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + delta).to(out_ptr.dtype.element_ty), mask=n_mask)
