"""Triton body of the fused per-head q/k RMSNorm + RoPE + K/V cache write (launcher: rope.py).

Shapes: R = rows, Hq / Hkv = query / KV heads, D = head dim, Dv = value head dim, RD = rotary dim,
HALF = RD // 2, PASS = D - RD (dims after the rotary span, passed through).
KV_FP8: e4m3 pools, K / V divided by the layer's k_scale / v_scale ([1] fp32) before the store
(``_kv_write_jit.kv_store_value``); EMULATE_FP8: its interpreter rounding.
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparrow.kernels.attention._kv_write_jit import kv_store_value
from sparrow.kernels.common._pdl_jit import pdl_enter


@triton.jit
def _normed(x, w_ptr, offs, mask, rstd, HAS_NORM: tl.constexpr, GEMMA: tl.constexpr, norm_offset,
            OUT_DTYPE: tl.constexpr):
    """RMSNorm of fp32 x (already loaded) given rstd, rounded to the activation dtype, returned as fp32.
    GEMMA: (x * rstd * (norm_offset + w)) in fp32, one rounding (HF Gemma3/Gemma4RMSNorm);
    else w * (x * rstd).to(dtype) (HF LlamaRMSNorm: two roundings)."""
    if HAS_NORM:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:
            y = (x * rstd * (norm_offset + w)).to(OUT_DTYPE)
        else:
            y = ((x * rstd).to(OUT_DTYPE).to(tl.float32) * w).to(OUT_DTYPE)
        return y.to(tl.float32)
    else:
        return x


@triton.jit
def _norm_rope_head(
    x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, write, norm_offset, eps, cache_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, HAS_NORM: tl.constexpr, GEMMA: tl.constexpr, HAS_CACHE: tl.constexpr,
    KV_FP8: tl.constexpr, EMULATE_FP8: tl.constexpr,
):
    """Norm + rope of one head vector at x_ptr [D]; stores to out_ptr [D] and, if HAS_CACHE and the
    runtime flag ``write``, to cache_ptr [D] (``kv_store_value`` with ``cache_scale``)."""
    dtype = out_ptr.dtype.element_ty
    rstd = 1.0
    if HAS_NORM:
        offs = tl.arange(0, D_PAD)
        x = tl.load(x_ptr + offs, mask=offs < HEAD_DIM, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
    offs_h = tl.arange(0, HALF_PAD)
    h_mask = offs_h < HALF
    x1 = tl.load(x_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    x1 = _normed(x1, w_ptr, offs_h, h_mask, rstd, HAS_NORM, GEMMA, norm_offset, dtype)
    x2 = _normed(x2, w_ptr, HALF + offs_h, h_mask, rstd, HAS_NORM, GEMMA, norm_offset, dtype)
    cos = tl.load(cos_ptr + offs_h, mask=h_mask, other=1.0)
    sin = tl.load(sin_ptr + offs_h, mask=h_mask, other=0.0)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(out_ptr + offs_h, y1, mask=h_mask)
    tl.store(out_ptr + HALF + offs_h, y2, mask=h_mask)
    if HAS_CACHE:
        if write:
            cdt = cache_ptr.dtype.element_ty
            tl.store(cache_ptr + offs_h, kv_store_value(y1, cache_scale, cdt, KV_FP8, EMULATE_FP8), mask=h_mask)
            tl.store(cache_ptr + HALF + offs_h, kv_store_value(y2, cache_scale, cdt, KV_FP8, EMULATE_FP8),
                     mask=h_mask)
    if PASS_PAD > 0:
        offs_p = 2 * HALF + tl.arange(0, PASS_PAD)
        p_mask = offs_p < HEAD_DIM
        x3 = tl.load(x_ptr + offs_p, mask=p_mask, other=0.0).to(tl.float32)
        y3 = _normed(x3, w_ptr, offs_p, p_mask, rstd, HAS_NORM, GEMMA, norm_offset, dtype).to(dtype)
        tl.store(out_ptr + offs_p, y3, mask=p_mask)
        if HAS_CACHE:
            if write:
                tl.store(cache_ptr + offs_p,
                         kv_store_value(y3, cache_scale, cache_ptr.dtype.element_ty, KV_FP8, EMULATE_FP8),
                         mask=p_mask)


@triton.jit
def qk_norm_rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, norm_offset, eps,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_cs,
    stride_qor, stride_qoh, stride_kor, stride_koh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, GEMMA: tl.constexpr, V_NORM: tl.constexpr,
    K_EQ_V: tl.constexpr, KV_FP8: tl.constexpr = False, EMULATE_FP8: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    """grid (R, Hq + Hkv): program (r, h) normalizes and rotates q head h (h < Hq) or k head h - Hq, and
    for a k head also writes K and the (optionally scale-free-normed) V of row r to the cache at
    slot_mapping[r] (skipped when the slot is < 0). With K_EQ_V, V is the raw k head (before norm/RoPE)."""
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + r)
    cos_ptr = cos_sin_ptr + pos * stride_cs
    sin_ptr = cos_ptr + HALF
    if h < NUM_Q_HEADS:
        _norm_rope_head(
            q_ptr + r * stride_qr + h * stride_qh, q_out_ptr + r * stride_qor + h * stride_qoh, qw_ptr,
            cos_ptr, sin_ptr, q_out_ptr, False, norm_offset, eps, 1.0,
            HEAD_DIM, D_PAD, HALF, HALF_PAD, PASS_PAD, HAS_Q_NORM, GEMMA, False, False, False,
        )
    else:
        kh = h - NUM_Q_HEADS
        slot = tl.load(slot_ptr + r)
        write = slot >= 0
        slot = tl.maximum(slot, 0)
        ks = 1.0
        vs = 1.0
        if KV_FP8:
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
        _norm_rope_head(
            k_ptr + r * stride_kr + kh * stride_kh, k_out_ptr + r * stride_kor + kh * stride_koh, kw_ptr,
            cos_ptr, sin_ptr, k_cache_ptr + slot * stride_kcs + kh * stride_kch, write, norm_offset, eps, ks,
            HEAD_DIM, D_PAD, HALF, HALF_PAD, PASS_PAD, HAS_K_NORM, GEMMA, True, KV_FP8, EMULATE_FP8,
        )
        if write:
            offs = tl.arange(0, DV_PAD)
            mask = offs < DV
            if K_EQ_V:
                v = tl.load(k_ptr + r * stride_kr + kh * stride_kh + offs, mask=mask, other=0.0)
            else:
                v = tl.load(v_ptr + r * stride_vr + kh * stride_vh + offs, mask=mask, other=0.0)
            if V_NORM:
                vf = v.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(vf * vf, 0) / DV + eps)
                v = (vf * rstd).to(v.dtype)
            v = kv_store_value(v, vs, v_cache_ptr.dtype.element_ty, KV_FP8, EMULATE_FP8)
            tl.store(v_cache_ptr + slot * stride_vcs + kh * stride_vch + offs, v, mask=mask)
