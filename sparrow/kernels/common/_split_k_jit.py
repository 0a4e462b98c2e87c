"""Triton helpers of split-K with an in-kernel reduce (workspace management: ``sparrow.kernels.common.split_k``).

A GEMV / skinny GEMM whose output has few tiles (decode: N = 2816 gives 88 tiles of 32 columns for 132
SMs) cannot keep enough weight bytes in flight with one program per output tile. Split-K runs SPLIT_K
programs per tile, each over a contiguous K range, and reduces them without a second launch ("serial
split-K with a semaphore", as in CUTLASS's split-K-serial and stream-K GEMMs):

1. every program stores its fp32 partial tile in its workspace slot (``split_k_store``, one call per
   accumulator; slot = (tile * SPLIT_K + split) * NACC + i, BM * BN floats each);
2. ``split_k_arrive``: a CTA barrier, then one acq_rel atomic increment of the tile's counter at GPU scope;
   the program that brings it to SPLIT_K is the tile's last, and resets the counter to 0 for the next call;
3. the last program sums the SPLIT_K partials in split order (``split_k_sum``: deterministic, whichever
   program arrives last) from L2 (``.cg`` loads bypass the non-coherent L1) and runs the epilogue.

``split_k_reduce`` is the three steps for a kernel with one accumulator.

The counters must be 0 before a launch: ``split_k.workspace`` allocates them zeroed and each tile resets its
own counter, so back-to-back launches on one stream (and CUDA-graph replays) need no memset.
"""
import triton
import triton.language as tl


@triton.jit
def split_k_range(K, split, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(k_start, k_end) of program ``split``: contiguous runs of whole BLOCK_K steps (the last may be short
    or empty)."""
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * per
    return k_start, tl.minimum(k_start + per, K)


@triton.jit
def split_k_store(acc, ws_ptr, slot, BM: tl.constexpr, BN: tl.constexpr):
    """Store the fp32 [BM, BN] partial ``acc`` at workspace slot ``slot``."""
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    tl.store(ws_ptr + slot.to(tl.int64) * (BM * BN) + offs, acc)


@triton.jit
def split_k_arrive(lock_ptr, tile, SPLIT_K: tl.constexpr):
    """After this program's ``split_k_store`` calls: count it in; True for the tile's last program (which
    also resets the counter)."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    count = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = count == SPLIT_K - 1
    tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu", mask=last)
    return last


@triton.jit
def split_k_sum(ws_ptr, first_slot, last, SPLIT_K: tl.constexpr, NACC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    """Sum over the SPLIT_K partials at slots first_slot + s * NACC (s in split order); zeros unless ``last``."""
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    total = tl.zeros([BM, BN], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ptr = ws_ptr + (first_slot + s * NACC).to(tl.int64) * (BM * BN) + offs
        total += tl.load(ptr, mask=split_k_and(offs >= 0, last), other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def split_k_reduce(acc, ws_ptr, lock_ptr, tile, split, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(sum over the tile's SPLIT_K partials of ``acc`` [BM, BN] fp32, True for the tile's last program); the
    sum is zeros in the other programs, which must not store it."""
    split_k_store(acc, ws_ptr, tile * SPLIT_K + split, BM, BN)
    last = split_k_arrive(lock_ptr, tile, SPLIT_K)
    return split_k_sum(ws_ptr, tile * SPLIT_K, last, SPLIT_K, 1, BM, BN), last


@triton.jit
def split_k_and(mask, last):
    """``mask & last`` for a scalar ``last`` (written as a broadcast sum: the interpreter's scalar & tensor
    yields integers, which it does not take as a mask)."""
    return mask & ((mask.to(tl.int32) * 0 + last.to(tl.int32)) != 0)
