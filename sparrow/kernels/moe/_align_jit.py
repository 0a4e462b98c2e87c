"""Triton bodies of the pair sort of the grouped MoE path (launcher and torch twin: ``sparrow.kernels.moe.moe_align``).

Shapes: P = R * K (row, expert) pairs, E experts (E_PAD a power of two), C chunks of BLOCK_P pairs, S = padded
sorted length, NB = S // BLOCK_M blocks.

``align_count_kernel`` / ``align_offsets_kernel`` / ``align_scatter_kernel``, one launch each: pairs sorted (stably)
by expert, each expert's segment padded to a multiple of BLOCK_M with the sentinel P, the expert of every block (-1
past the end) and the padded total, all on the device into worst-case-sized buffers.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["P"])  # step-varying counts: one variant (sparrow.engine.warmup)
def align_count_kernel(
    ids_ptr,  # [P] flattened topk_ids
    counts_ptr,  # [C, E_PAD] int32 out: pairs per expert in each chunk of BLOCK_P pairs
    rank_ptr,  # [P] int32 out: a pair's rank among its chunk's pairs of the same expert
    P,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)
    m = offs < P
    ids = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
    ex = tl.arange(0, E_PAD)
    onehot = (ids[:, None] == ex[None, :]).to(tl.int32)  # [BLOCK_P, E_PAD]
    tl.store(counts_ptr + c * E_PAD + ex, tl.sum(onehot, axis=0))
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    tl.store(rank_ptr + offs, rank, mask=m)


@triton.jit(do_not_specialize=["C", "P", "S", "NB"])  # step-varying counts: one variant (sparrow.engine.warmup)
def align_offsets_kernel(
    counts_ptr,  # [C, E_PAD] int32 from align_count_kernel
    chunk_off_ptr,  # [C, E_PAD] int32 out: pairs of each expert in earlier chunks
    start_ptr,  # [E_PAD] int32 out: first sorted position of each expert's segment
    sorted_ptr,  # [S] int32 out: filled with the sentinel P here, pairs scattered later
    block_expert_ptr,  # [NB] int32 out
    total_ptr,  # [1] int32 out
    C, P, S, NB,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):
    ex = tl.arange(0, E_PAD)
    run = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(0, C):
        cnt = tl.load(counts_ptr + c * E_PAD + ex)
        tl.store(chunk_off_ptr + c * E_PAD + ex, run)
        run += cnt
    padded = (run + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + ex, end - padded)
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    bs = tl.arange(0, BLOCK_S)
    for b0 in range(0, NB, BLOCK_S):
        pos = (b0 + bs) * BLOCK_M
        owner = tl.sum((end[None, :] <= pos[:, None]).to(tl.int32), axis=1)  # segments ending at or before pos
        tl.store(block_expert_ptr + b0 + bs, tl.where(pos < total, owner, -1), mask=b0 + bs < NB)
    for s0 in range(0, S, BLOCK_S):
        tl.store(sorted_ptr + s0 + bs, tl.zeros([BLOCK_S], dtype=tl.int32) + P, mask=s0 + bs < S)


@triton.jit(do_not_specialize=["P"])  # step-varying counts: one variant (sparrow.engine.warmup)
def align_scatter_kernel(
    ids_ptr, rank_ptr, chunk_off_ptr, start_ptr,  # as above
    sorted_ptr,  # [S] int32: sorted[start[e] + chunk_off[c, e] + rank[p]] = p
    P,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)
    m = offs < P
    ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
    pos = (tl.load(start_ptr + ids, mask=m, other=0) + tl.load(chunk_off_ptr + c * E_PAD + ids, mask=m, other=0)
           + tl.load(rank_ptr + offs, mask=m, other=0))
    tl.store(sorted_ptr + pos, offs, mask=m)
