"""Triton helpers of the 4-bit FMA GEMV (``_w4_fma_rows``: 1, 2 or 4 rows of fp32 FMAs on the decoded weights,
no dots), shared by the dense kernel (``_int4_jit``) and the routed experts (``sparrow.kernels.moe._w4_moe_jit``).
Shapes and formats: ``_w4_jit``.
"""
import triton
import triton.language as tl

from sparrow.kernels.common.tiles import FMA_ROWS
from sparrow.kernels.gemm._w4_jit import NV_PRE, e2m1_values, int4_values


FMA_MAX_ROWS = tl.constexpr(max(FMA_ROWS))  # rows of one FMA program (``_w4_fma_rows``): one accumulator each


@triton.jit
def _w4_fma_load(w_rows, s_rows, z_rows, k0, k_end, n_mask, load_ok, group: tl.constexpr, NVFP4: tl.constexpr,
                 HAS_ZERO: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr):
    """The operands of one ``_w4_fma_step`` at k0 (loaded one step ahead of their use): words int32 [BN, BK / 8],
    the scales (NVFP4: e4m3 [BN, BK / 16]; int4: the step's group, [BN, 1]: BK <= group) and the int4 zero points
    ([BN, 1], or the scales as a dummy); nothing where not ``load_ok`` (a scalar) or, with MASK_K, past k_end."""
    W: tl.constexpr = BK // 8
    kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, W), W), W)
    row_ok = tl.where(load_ok, n_mask, False)  # [BN]
    if MASK_K:
        mask = row_ok[:, None] & (kw < k_end // 8)[None, :]
    else:
        mask = row_ok[:, None]  # constant along K: 16-byte loads
    words = tl.load(w_rows + kw[None, :], mask=mask, other=0)
    if NVFP4:
        kg = k0 // 16 + tl.arange(0, BK // 16)
        if MASK_K:
            s_mask = row_ok[:, None] & (kg < k_end // 16)[None, :]
        else:
            s_mask = row_ok[:, None]
        sc = tl.load(s_rows[:, None] + kg[None, :], mask=s_mask, other=0.0)
        z = sc
    else:
        gi = tl.minimum(k0, k_end - 1) // group  # a step wholly past K adds 0; keep the scale in bounds
        sc = tl.load(s_rows + gi, mask=row_ok, other=0.0)[:, None]
        if HAS_ZERO:
            z = tl.load(z_rows + gi, mask=row_ok, other=8)[:, None]
        else:
            z = sc
    return words, sc, z


@triton.jit
def _x_step(x_row, k0, k_end, BK: tl.constexpr, MASK_K: tl.constexpr):
    """x[row, k0:k0 + BK] in fp32 (zero past k_end with MASK_K; else unmasked: 16-byte loads of a valid row)."""
    cols = k0 + tl.arange(0, BK)
    if MASK_K:
        v = tl.load(x_row + cols, mask=cols < k_end, other=0.0)
    else:
        v = tl.load(x_row + cols)
    return v.to(tl.float32)[None, :]


@triton.jit
def _w4_fma_step(acc0, acc1, acc2, acc3, x0, x1, x2, x3, words, sc, zp, k0, k_end,
                 NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, MASK_K: tl.constexpr):
    """acc_m [BN, 1] fp32 (m < ROWS) += row m's products with the BK columns at k0, on fp32 FMAs (no dot): the words
    decoded in place into column order (``int4_values`` / ``e2m1_values``: register moves), times x_m[k0:k0 + BK]
    (x_m: row m's pointer), summed over the step. int4: u - zero, the sum times the group's scale (BK inside one
    group); NVFP4: e2m1 times its 16-column block's e4m3 scale times 2^64 (exact, normal fp32), the caller
    multiplying by 2^62 and the global multiplier. words / sc / zp from ``_w4_fma_load``."""
    if NVFP4:
        s16 = sc.to(tl.float32) * NV_PRE
        s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], [BN, BK // 16, 16]), [BN, BK])
        w = e2m1_values(words, BN, BK) * s16
    else:
        if HAS_ZERO:
            z = zp.to(tl.float32)
        else:
            z = tl.full([BN, 1], 8.0, tl.float32)
        w = int4_values(words, z, BN, BK)
    p0 = tl.sum(w * _x_step(x0, k0, k_end, BK, MASK_K), axis=1, keep_dims=True)
    if ROWS > 1:
        p1 = tl.sum(w * _x_step(x1, k0, k_end, BK, MASK_K), axis=1, keep_dims=True)
    if ROWS > 2:
        p2 = tl.sum(w * _x_step(x2, k0, k_end, BK, MASK_K), axis=1, keep_dims=True)
        p3 = tl.sum(w * _x_step(x3, k0, k_end, BK, MASK_K), axis=1, keep_dims=True)
    if not NVFP4:
        s = sc.to(tl.float32)
        p0 = p0 * s
        if ROWS > 1:
            p1 = p1 * s
        if ROWS > 2:
            p2 = p2 * s
            p3 = p3 * s
    acc0 += p0
    if ROWS > 1:
        acc1 += p1
    if ROWS > 2:
        acc2 += p2
        acc3 += p3
    return acc0, acc1, acc2, acc3


@triton.jit
def _fma_row(t, rows, m):
    """Element m of the [BM] tensor ``t`` as a scalar."""
    return tl.sum(tl.where(rows == m, t, 0), axis=0)


@triton.jit
def _fma_out(acc0, acc1, acc2, acc3, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] fp32 whose row m is acc_m [BN, W] summed over W."""
    rows = tl.arange(0, BM)[:, None]
    out = tl.zeros([BM, BN], dtype=tl.float32) + tl.sum(acc0, axis=1)[None, :]
    if BM > 1:
        out = tl.where(rows == 1, tl.sum(acc1, axis=1)[None, :], out)
    if BM > 2:
        out = tl.where(rows == 2, tl.sum(acc2, axis=1)[None, :], out)
        out = tl.where(rows == 3, tl.sum(acc3, axis=1)[None, :], out)
    return out


@triton.jit
def _w4_fma_rows(a_ptr, arow, m_mask, stride_ar, w_ptr, stride_wn, s_ptr, z_ptr, stride_sn, stride_zn,
                 rn, n_mask, N_UP, k_start, k_end, group: tl.constexpr, GATED: tl.constexpr, NVFP4: tl.constexpr,
                 HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_w4_mm_rows`` on FMAs (``_w4_fma_step``), the GEMV of BLOCK_M <= FMA_MAX_ROWS rows (1, 2 or 4), one fp32
    FMA per weight element and row: (acc_gate, acc_up) [BM, BN] fp32. A row of ``arow`` [BM] (int64) is valid
    where ``m_mask``. Whole BLOCK_K steps over k_start:k_end (k_start a multiple of BLOCK_K) with each step's
    words and scales loaded during the step before (two steps of weight bytes in flight a program), then one masked
    tail step; int4 needs BLOCK_K <= group (one scale a step)."""
    tl.static_assert(BLOCK_M <= FMA_MAX_ROWS, "FMA rows: at most FMA_MAX_ROWS")
    rows = tl.arange(0, BLOCK_M)
    safe = tl.where(m_mask, arow, 0)  # invalid rows read row 0 (their sums are never stored)
    x0 = a_ptr + _fma_row(safe, rows, 0) * stride_ar
    x1 = a_ptr + _fma_row(safe, rows, 1) * stride_ar
    x2 = a_ptr + _fma_row(safe, rows, 2) * stride_ar
    x3 = a_ptr + _fma_row(safe, rows, 3) * stride_ar
    g0 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    g1 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    g2 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    g3 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    u0 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    u1 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    u2 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    u3 = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
    rg = rn.to(tl.int64)
    ru = (rn + N_UP).to(tl.int64)
    wg_rows = w_ptr + rg[:, None] * stride_wn
    wu_rows = w_ptr + ru[:, None] * stride_wn
    sg_rows, zg_rows = s_ptr + rg * stride_sn, z_ptr + rg * stride_zn
    su_rows, zu_rows = s_ptr + ru * stride_sn, z_ptr + ru * stride_zn
    k_full = k_start + (k_end - k_start) // BLOCK_K * BLOCK_K
    wg, sg, zg = _w4_fma_load(wg_rows, sg_rows, zg_rows, k_start, k_end, n_mask, k_start < k_full, group, NVFP4,
                              HAS_ZERO, BLOCK_N, BLOCK_K, False)
    if GATED:
        wu, su, zu = _w4_fma_load(wu_rows, su_rows, zu_rows, k_start, k_end, n_mask, k_start < k_full, group,
                                  NVFP4, HAS_ZERO, BLOCK_N, BLOCK_K, False)
    else:
        wu, su, zu = wg, sg, zg
    for k0 in range(k_start, k_full, BLOCK_K):
        more = k0 + BLOCK_K < k_full
        wg_n, sg_n, zg_n = _w4_fma_load(wg_rows, sg_rows, zg_rows, k0 + BLOCK_K, k_end, n_mask, more, group, NVFP4,
                                        HAS_ZERO, BLOCK_N, BLOCK_K, False)
        if GATED:
            wu_n, su_n, zu_n = _w4_fma_load(wu_rows, su_rows, zu_rows, k0 + BLOCK_K, k_end, n_mask, more, group,
                                            NVFP4, HAS_ZERO, BLOCK_N, BLOCK_K, False)
        else:
            wu_n, su_n, zu_n = wg_n, sg_n, zg_n
        g0, g1, g2, g3 = _w4_fma_step(g0, g1, g2, g3, x0, x1, x2, x3, wg, sg, zg, k0, k_end,
                                      NVFP4, HAS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, False)
        if GATED:
            u0, u1, u2, u3 = _w4_fma_step(u0, u1, u2, u3, x0, x1, x2, x3, wu, su, zu, k0, k_end,
                                          NVFP4, HAS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, False)
        wg, sg, zg, wu, su, zu = wg_n, sg_n, zg_n, wu_n, su_n, zu_n
    if k_full < k_end:
        wg, sg, zg = _w4_fma_load(wg_rows, sg_rows, zg_rows, k_full, k_end, n_mask, True, group, NVFP4, HAS_ZERO,
                                  BLOCK_N, BLOCK_K, True)
        g0, g1, g2, g3 = _w4_fma_step(g0, g1, g2, g3, x0, x1, x2, x3, wg, sg, zg, k_full, k_end,
                                      NVFP4, HAS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, True)
        if GATED:
            wu, su, zu = _w4_fma_load(wu_rows, su_rows, zu_rows, k_full, k_end, n_mask, True, group, NVFP4,
                                      HAS_ZERO, BLOCK_N, BLOCK_K, True)
            u0, u1, u2, u3 = _w4_fma_step(u0, u1, u2, u3, x0, x1, x2, x3, wu, su, zu, k_full,
                                          k_end, NVFP4, HAS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, True)
    return _fma_out(g0, g1, g2, g3, BLOCK_M, BLOCK_N), _fma_out(u0, u1, u2, u3, BLOCK_M, BLOCK_N)
