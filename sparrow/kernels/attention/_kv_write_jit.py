"""Triton bodies of the paged KV write (launcher and torch twin in paged_attention.py), and ``kv_store_value``,
the conversion every kernel that writes the KV pool applies (this one and the fused rope + KV write, _rope_jit).

FP8 pools (e4m3, ``sparrow.kv_cache``): the stored value is ``clamp(x / scale, -448, 448)`` rounded to the
nearest e4m3 (ties to even), scale the layer's per-tensor fp32 k_scale / v_scale ([1] on the device). Under the
interpreter the rounding is done in fp32 (``_fp8_jit.round_e4m3``: its fp32 -> e4m3 cast rounds wrongly across
binades), so the kernels and ``paged_attention.quantize_kv_ref`` agree bit for bit.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import round_e4m3


@triton.jit
def kv_store_value(x, scale, out_dtype: tl.constexpr, KV_FP8: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """x (any float dtype) -> the values stored in a pool of ``out_dtype``: a plain cast, or for an FP8 pool
    (KV_FP8) x / scale in fp32, saturated to +-448 and rounded to e4m3."""
    if KV_FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
        if EMULATE_FP8:
            r = round_e4m3(y)
            y = tl.where(r == 0.0, y * 0.0, r)  # keep the sign of values that round to zero (-0), as torch does
        return y.to(out_dtype)
    else:
        return x.to(out_dtype)


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                    stride_kr, stride_vr, KD: tl.constexpr, VD: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, KV_FP8: tl.constexpr = False,
                    EMULATE_FP8: tl.constexpr = False):
    """One program per row: copy k[row] (Hkv*D contiguous values) and v[row] to the pool at slot[row];
    rows with slot < 0 are skipped. The pool is viewed flat as [N*B, Hkv*D]. KV_FP8: e4m3 pools, values
    divided by k_scale / v_scale ([1] fp32) first (``kv_store_value``)."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        ks = 1.0
        vs = 1.0
        if KV_FP8:
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
        offs = tl.arange(0, BLOCK_K)
        for start in range(0, KD, BLOCK_K):
            m = start + offs < KD
            x = tl.load(k_ptr + row * stride_kr + start + offs, mask=m)
            x = kv_store_value(x, ks, k_cache_ptr.dtype.element_ty, KV_FP8, EMULATE_FP8)
            tl.store(k_cache_ptr + slot * KD + start + offs, x, mask=m)
        offs_v = tl.arange(0, BLOCK_V)
        for start in range(0, VD, BLOCK_V):
            m = start + offs_v < VD
            x = tl.load(v_ptr + row * stride_vr + start + offs_v, mask=m)
            x = kv_store_value(x, vs, v_cache_ptr.dtype.element_ty, KV_FP8, EMULATE_FP8)
            tl.store(v_cache_ptr + slot * VD + start + offs_v, x, mask=m)
