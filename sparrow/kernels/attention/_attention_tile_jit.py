"""Triton helpers of the paged attention kernels (_attention_jit.py): a key tile's pool pages, the q.k tile product,
the p.v step, 16-bit dots with the interpreter's workaround, and tanh for the soft-cap.

Shapes as _attention_jit.py: BLOCK_Q query rows, BLOCK_N keys, D walked in BLOCK_D chunks.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh_finite(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): finite for every x (exp overflow gives 1, underflow -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def dot16(a, b, UPCAST: tl.constexpr):
    """a @ b for 16-bit operands with fp32 accumulation. UPCAST: same numbers through an fp32 dot (the
    Triton 3.9 interpreter's bf16 tl.dot reads the raw bits as integers)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def qk_scores(
    q_ptr, q_row_off, q_head_off, q_mask, k_ptr, k_tok_off, n_mask,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, UPCAST: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """q [BLOCK_Q, D] . k [BLOCK_N, D]^T -> fp32 [BLOCK_Q, BLOCK_N], D walked in BLOCK_D chunks.
    q_row_off / q_head_off: [BLOCK_Q] element offsets (summed); k_tok_off: [BLOCK_N] element offsets.
    KV_FP8: k is e4m3, widened to q's dtype (the caller applies k_scale)."""
    scores = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
    for d0 in tl.static_range(0, HEAD_DIM_PAD, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        qc = tl.load(
            q_ptr + (q_row_off + q_head_off)[:, None] + offs_d[None, :],
            mask=q_mask[:, None] & d_mask[None, :], other=0.0,
        )  # [BLOCK_Q, BLOCK_D]
        kc = tl.load(
            k_ptr + k_tok_off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
        )  # [BLOCK_D, BLOCK_N]
        if DOT_FP32:
            scores += tl.dot(qc.to(tl.float32), kc.to(tl.float32), input_precision="ieee")
        elif KV_FP8:
            scores += dot16(qc, kc.to(qc.dtype), UPCAST)
        else:
            scores += dot16(qc.to(kc.dtype), kc, UPCAST)
    return scores



@triton.jit
def paged_kv_tile(block_tables_ptr, s, stride_bt, start, hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys start .. start + BLOCK_N of sequence s, live below hi: (offs_n [BLOCK_N] positions, n_mask, page
    [BLOCK_N] int64 pool pages from the block table, in_page: each key's slot in its page)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    page = tl.load(block_tables_ptr + s * stride_bt + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE
    return offs_n, n_mask, page, in_page


@triton.jit
def pv_step(acc, alpha, p, v_ptr, v_tok_off, offs_dv, n_mask, dv_mask, out_ptr,
            KV_FP8: tl.constexpr, DOT_FP32: tl.constexpr, UPCAST: tl.constexpr):
    """The online-softmax accumulator acc [BLOCK_Q, DV_PAD] fp32 rescaled by alpha [BLOCK_Q] plus p [BLOCK_Q, BLOCK_N]
    @ v, v the tile's values at v_tok_off [BLOCK_N] element offsets (KV_FP8: e4m3, widened to out's dtype; the
    caller applies v_scale)."""
    v = tl.load(
        v_ptr + v_tok_off[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0
    )  # [BLOCK_N, DV_PAD]
    if KV_FP8:
        v = v.to(out_ptr.dtype.element_ty)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + dot16(p.to(v.dtype), v, UPCAST)
    return acc
