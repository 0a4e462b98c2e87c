"""Triton bodies for paged attention (launchers and shape checks live in attention.py).

Shapes: R = rows, S = sequences, Hq / Hkv = query / KV heads, G = Hq // Hkv (GQA group), D = head dim,
Dv = value head dim, B = page (block) size, P = KV splits of a decode row, BN = KV tile, BM = query tile,
BD = D chunk of the q.k product (keeps D = 512 tiles small).

Cache layout and masking follow paged_attention.py: token t of sequence s sits in page
``block_tables[s, t // B]`` at offset ``t % B``; query at position ``pos`` sees keys ``p <= pos`` and, with a
window W, ``pos - p < W``. Softmax and accumulation are fp32 (online softmax, Dao et al., FlashAttention-2);
decode splits are merged by log-sum-exp (flash-decoding).

KV_FP8: e4m3 pools (``sparrow.kv_cache``) read directly: K / V tiles are widened to q's dtype (exact) for the
dots, and the per-tensor scales are applied to the products (scores x k_scale, the P.V sum x v_scale), which
equals dequantizing every element first (paged_attention.py's ``dequantize_kv_ref``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparrow.kernels.attention._attention_tile_jit import paged_kv_tile, pv_step, qk_scores, tanh_finite
from sparrow.kernels.common._pdl_jit import pdl_enter


@triton.jit
def _split_part(live, num_splits, BLOCK_N: tl.constexpr):
    """Keys per decode split: ceil(live / num_splits) rounded up to BLOCK_N (>= BLOCK_N), so at most
    num_splits splits are live and each but the last holds whole tiles."""
    return tl.maximum(tl.cdiv(tl.cdiv(live, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_acc_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    scale, soft_cap, window,
    stride_qr, stride_qh,
    stride_kn, stride_kb, stride_kh,
    stride_vn, stride_vb, stride_vh,
    stride_bt, stride_or, stride_oh,
    stride_pas, stride_pah, stride_pap,
    stride_pls, stride_plh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    UPCAST: tl.constexpr, KV_FP8: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    """One decode row (sequence s), one KV head and its G query heads, one KV split.

    grid (S, Hkv, P). The split covers keys [kv_start + p * part, ...) with kv_start = 0, or ctx - W under a
    window, and part = ``_split_part`` (this sequence's live keys over P, rounded up to BLOCK_N: read from
    seq_lens here, so a graph captured for the longest context still spreads a short one over P programs).
    SPLIT: write fp32 partials part_acc [S, Hq, P, Dv] (already divided by the split's softmax sum) and
    part_lse [S, Hq, P]; else (one split) write out [R, Hq, Dv] directly. Empty splits
    write nothing (the reduce recomputes how many splits are live). KV_FP8: e4m3 pools, scaled by
    k_scale / v_scale ([1] fp32).
    """
    pdl_enter(USE_PDL)
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + s)
    ctx = tl.load(seq_lens_ptr + s)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx - window, 0)
    if SPLIT:
        part = _split_part(ctx - kv_start, tl.num_programs(2), BLOCK_N)
    else:
        part = ctx - kv_start
    lo = kv_start + split * part
    hi = tl.minimum(lo + part, ctx)
    if lo >= hi:
        return

    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q_row_off = (row * stride_qr + offs_g * 0).to(tl.int64)
    q_head_off = heads * stride_qh
    offs_dv = tl.arange(0, DV_PAD)
    dv_mask = offs_dv < DV

    qk_scale = scale
    if KV_FP8:  # e4m3 pools: stored x k_scale, so the q.k products take it (v_scale: after the loop)
        qk_scale = scale * tl.load(k_scale_ptr)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DV_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n, n_mask, page, in_page = paged_kv_tile(block_tables_ptr, s, stride_bt, start, hi, PAGE, BLOCK_N)
        k_tok_off = page * stride_kn + in_page * stride_kb + kvh * stride_kh
        scores = qk_scores(
            q_ptr, q_row_off, q_head_off, g_mask, k_ptr, k_tok_off, n_mask,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_D, DOT_FP32, UPCAST, GROUP_PAD, BLOCK_N, KV_FP8,
        ) * qk_scale
        if USE_SOFTCAP:
            scores = soft_cap * tanh_finite(scores / soft_cap)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        # every tile holds >= 1 live key, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tok_off = page * stride_vn + in_page * stride_vb + kvh * stride_vh
        acc = pv_step(acc, alpha, p, v_ptr, v_tok_off, offs_dv, n_mask, dv_mask, out_ptr, KV_FP8, DOT_FP32, UPCAST)
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    acc = acc / l_i[:, None]
    st_mask = g_mask[:, None] & dv_mask[None, :]
    if SPLIT:
        pa = part_acc_ptr + s * stride_pas + heads[:, None] * stride_pah + split * stride_pap + offs_dv[None, :]
        tl.store(pa, acc, mask=st_mask)
        tl.store(part_lse_ptr + s * stride_pls + heads * stride_plh + split, m_i + tl.log(l_i), mask=g_mask)
    else:
        po = out_ptr + row.to(tl.int64) * stride_or + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(po, acc.to(out_ptr.dtype.element_ty), mask=st_mask)


@triton.jit(do_not_specialize=["num_splits"])  # step-varying counts: one variant (sparrow.engine.warmup)
def paged_decode_reduce_kernel(
    part_acc_ptr, part_lse_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    window, num_splits,
    stride_pas, stride_pah, stride_pap, stride_pls, stride_plh, stride_or, stride_oh,
    DV: tl.constexpr, DV_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the decode kernel's, for its split size (_split_part)
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    """Merge the live splits of one (sequence, q head): out = sum_p exp(lse_p - lse) * acc_p. grid (S, Hq).
    BLOCK_P splits per loop step, loaded as one [BLOCK_P, DV_PAD] tile (independent loads in flight)."""
    pdl_enter(USE_PDL)
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + s)
    ctx = tl.load(seq_lens_ptr + s)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx - window, 0)
    live = tl.cdiv(ctx - kv_start, _split_part(ctx - kv_start, num_splits, BLOCK_N))
    offs_p = tl.arange(0, SPLITS_PAD)
    lse = tl.load(part_lse_ptr + s * stride_pls + h * stride_plh + offs_p, mask=offs_p < live, other=float("-inf"))
    m = tl.max(lse, 0)
    total = tl.sum(tl.exp(lse - m), 0)
    offs_dv = tl.arange(0, DV_PAD)
    dv_mask = offs_dv < DV
    acc = tl.zeros([DV_PAD], dtype=tl.float32)
    offs_bp = tl.arange(0, BLOCK_P)
    for p0 in range(0, live, BLOCK_P):
        pp = p0 + offs_bp
        p_mask = pp < live
        w = tl.exp(tl.load(part_lse_ptr + s * stride_pls + h * stride_plh + pp, mask=p_mask, other=float("-inf")) - m)
        a = tl.load(part_acc_ptr + s * stride_pas + h * stride_pah + pp[:, None] * stride_pap + offs_dv[None, :],
                    mask=p_mask[:, None] & dv_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    acc = acc / total
    tl.store(out_ptr + row.to(tl.int64) * stride_or + h * stride_oh + offs_dv, acc.to(out_ptr.dtype.element_ty),
             mask=dv_mask)


@triton.jit(do_not_specialize=["num_seqs"])  # step-varying counts: one variant (sparrow.engine.warmup)
def paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    scale, soft_cap, window, num_seqs,
    stride_qr, stride_qh,
    stride_kn, stride_kb, stride_kh,
    stride_vn, stride_vb, stride_vh,
    stride_bt, stride_or, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """One tile of BLOCK_M query rows of one sequence, one q head, causal over the paged cache (KV_FP8: e4m3
    pools, scaled by k_scale / v_scale, [1] fp32).

    grid (R // BLOCK_M + S, Hq). Query tile j of sequence s is program ``qsl[s] // BLOCK_M + s + j``
    (so no host-side count of tiles is needed); programs that land in the gaps exit.
    """
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    # largest s with qsl[s] // BLOCK_M + s <= pid
    s_lo = 0
    s_hi = num_seqs - 1
    while s_lo < s_hi:
        mid = (s_lo + s_hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= pid:
            s_lo = mid
        else:
            s_hi = mid - 1
    s = s_lo
    q0 = tl.load(query_start_loc_ptr + s)
    q_len = tl.load(query_start_loc_ptr + s + 1) - q0
    tile = pid - (q0 // BLOCK_M + s)
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + s)
    first_pos = ctx - q_len
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = first_pos + offs_m
    hi = first_pos + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)  # last live query position + 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + tile * BLOCK_M - window + 1, 0)

    q_row_off = (q0 + offs_m).to(tl.int64) * stride_qr
    q_head_off = (offs_m * 0 + h) * stride_qh
    offs_dv = tl.arange(0, DV_PAD)
    dv_mask = offs_dv < DV
    qk_scale = scale
    if KV_FP8:  # e4m3 pools: stored x k_scale, so the q.k products take it (v_scale: after the loop)
        qk_scale = scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n, n_mask, page, in_page = paged_kv_tile(block_tables_ptr, s, stride_bt, start, hi, PAGE, BLOCK_N)
        k_tok_off = page * stride_kn + in_page * stride_kb + kvh * stride_kh
        scores = qk_scores(
            q_ptr, q_row_off, q_head_off, m_mask, k_ptr, k_tok_off, n_mask,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_D, DOT_FP32, UPCAST, BLOCK_M, BLOCK_N, KV_FP8,
        ) * qk_scale
        if USE_SOFTCAP:
            scores = soft_cap * tanh_finite(scores / soft_cap)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tok_off = page * stride_vn + in_page * stride_vb + kvh * stride_vh
        acc = pv_step(acc, alpha, p, v_ptr, v_tok_off, offs_dv, n_mask, dv_mask, out_ptr, KV_FP8, DOT_FP32, UPCAST)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padded rows only
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    acc = acc / l_i[:, None]
    po = out_ptr + (q0 + offs_m).to(tl.int64)[:, None] * stride_or + h * stride_oh + offs_dv[None, :]
    tl.store(po, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])
