"""Triton body of the paged KV write (launcher and torch twin in paged_attention.py)."""
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_kr, stride_vr, KD: tl.constexpr, VD: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: copy k[row] (Hkv*D contiguous values) and v[row] to the pool at slot[row];
    rows with slot < 0 are skipped. The pool is viewed flat as [N*B, Hkv*D]."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_K)
        for start in range(0, KD, BLOCK_K):
            m = start + offs < KD
            x = tl.load(k_ptr + row * stride_kr + start + offs, mask=m)
            tl.store(k_cache_ptr + slot * KD + start + offs, x.to(k_cache_ptr.dtype.element_ty), mask=m)
        offs_v = tl.arange(0, BLOCK_V)
        for start in range(0, VD, BLOCK_V):
            m = start + offs_v < VD
            x = tl.load(v_ptr + row * stride_vr + start + offs_v, mask=m)
            tl.store(v_cache_ptr + slot * VD + start + offs_v, x.to(v_cache_ptr.dtype.element_ty), mask=m)
