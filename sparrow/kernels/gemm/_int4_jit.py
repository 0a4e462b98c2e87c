"""Triton bodies of the 4-bit weight kernels, int4 W4A16 and NVFP4 W4A16 (launchers: ``sparrow.kernels.gemm.int4``,
``sparrow.kernels.moe.int4_moe``, ``sparrow.kernels.moe.nvfp4_moe``, ``sparrow.kernels.gemm.nvfp4_linear``).

Shapes: R = rows, N = output width, K = input width, BN x SUB_K = one weight tile of a dot.
Both formats are read as int32 words [N, K / 8] (NVFP4's uint8 [N, K / 2] codes viewed as int32: little-endian,
so nibble j of word w is column 8w + j in both): one wide, coalesced load of BN x SUB_K / 8 words per tile
(16-byte vectors: whole K steps carry no K mask, one masked tail step ends the range), decoded in place, plane by
plane (nibble j of every word), and put in column order by three rounds of ``tl.interleave`` (register moves).
- int4 (``sparrow.kernels.gemm.int4``'s layout, ``int4_values``): the word's nibble kept beside the fp32 exponent
  bits of 2^23 (one AND) is the fp32 2^23 + u 2^j; one FFMA gives u - zero exactly, exact in x's dtype; the
  dot sums x * (u - zero) in fp32 and its result is multiplied by the group's scale (one [BN] load per group and
  tile; SUB_K divides the group). With SCALE_W (GEMM tiles) the scale multiplies the weight tile before the dot
  instead, rounded to x's dtype once, so each K step is one accumulating dot;
- NVFP4 (``sparrow.kernels.gemm.nvfp4``, ``e2m1_values``): each code's sign and magnitude bits moved into an fp32
  bit pattern worth e2m1 * 2^-126 (e2m1's subnormal is fp32's), times its 16-column group's e4m3 scale * 2^64,
  rounded to x's dtype (exact: a 2-bit by 4-bit significand product), one dot per tile; the sums times 2^62
  and the fp32 global multiplier of each output row (or each expert half). fp16 activations (whose range ends
  at 2^-24) take the weights unscaled.
Dots are plain (rows as the MMA's M side, padded to 16) or swapped (SWAP_AB: the weight tile as M, wgmma from
BN = 64). FMA (``_w4_fma_rows``, GEMVs of 1, 2 or 4 rows): no dots; the decoded tile (fp32, column order) times
each row's x step (contiguous 16-byte loads) in fp32, summed per step, with the next step's words and scales
loaded during the current one. Accumulation is fp32; outputs are rounded once to x's dtype. UPCAST / RNE_OUT: the
interpreter's workarounds (``_fp8_jit``: dots on exactly widened fp32 operands, bf16 outputs rounded to nearest).
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import dot_upcast as _dot, rne_bf16 as _rne_bf16
from sparrow.kernels.moe._moe_jit import _epilogue
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_arrive, split_k_range, split_k_reduce, split_k_store, \
    split_k_sum
from sparrow.kernels.common.tiles import FMA_ROWS


# ---------------------------------------------------------------------------------------------- helpers


@triton.jit
def _int4_plane(base, zero, POS: tl.constexpr):
    """u - zero in fp32 for the nibble u at bits POS..POS + 3 (POS <= 16) of ``base``, a word whose bits 23..31
    are the fp32 exponent of 2^23 (0x4B000000): keeping those bits and the nibble (one AND) gives the fp32
    2^23 + u 2^POS; times 2^-POS minus (2^(23 - POS) + zero) is exact (one FFMA)."""
    v = (base & (0x4B000000 | (15 << POS))).to(tl.float32, bitcast=True)
    return v * (1.0 / (1 << POS)) - ((1 << (23 - POS)) + zero)


@triton.jit
def int4_values(words, zero, BN: tl.constexpr, BK: tl.constexpr):
    """int32 words [BN, BK / 8], zero fp32 [BN, 1] -> fp32 u - zero [BN, BK] (column k: nibble k % 8 of word
    k // 8): nibbles 0..4 read in place from (words & 0xFFFFF) | 0x4B000000, 5..7 from the word shifted right
    by 12, each with one AND and one FFMA (a few operations per word besides)."""
    lo = (words & 0xFFFFF) | 0x4B000000
    hi = ((words >> 12) & 0xFFF00) | 0x4B000000
    return tl.interleave(
        tl.interleave(tl.interleave(_int4_plane(lo, zero, 0), _int4_plane(lo, zero, 16)),
                      tl.interleave(_int4_plane(lo, zero, 8), _int4_plane(hi, zero, 12))),
        tl.interleave(tl.interleave(_int4_plane(lo, zero, 4), _int4_plane(hi, zero, 8)),
                      tl.interleave(_int4_plane(lo, zero, 12), _int4_plane(hi, zero, 16))))


@triton.jit
def _e2m1_plane(words, POS: tl.constexpr):
    """The e2m1 code at bits POS..POS + 3 of ``words`` as fp32 times 2^-126: its sign to bit 31 and its 3
    magnitude bits (e1 e0 m) to bits 24..22, so the fp32 exponent field is e and the top mantissa bit m (e = 0:
    an fp32 subnormal, as e2m1's own subnormal). Callers scale by 2^126 in two exact steps (``NV_PRE`` on the
    block scales, ``NV_POST`` on the sums)."""
    if POS <= 22:
        x = words << (22 - POS)
    else:
        x = words >> (POS - 22)
    return ((x & 0x01C00000) | ((x << 6) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_values(words, BN: tl.constexpr, BK: tl.constexpr):
    """int32 words [BN, BK / 8] of e2m1 codes -> fp32 [BN, BK] holding e2m1 * 2^-126 (``_e2m1_plane``), in
    column order (nibble k % 8 of word k // 8)."""
    return tl.interleave(
        tl.interleave(tl.interleave(_e2m1_plane(words, 0), _e2m1_plane(words, 16)),
                      tl.interleave(_e2m1_plane(words, 8), _e2m1_plane(words, 24))),
        tl.interleave(tl.interleave(_e2m1_plane(words, 4), _e2m1_plane(words, 20)),
                      tl.interleave(_e2m1_plane(words, 12), _e2m1_plane(words, 28))))


@triton.jit
def _nv_post(x_ptr, FMA: tl.constexpr = False):
    """The factor on NVFP4 sums for activations of x_ptr's dtype: NV_POST, or 1 for fp16 on the dots (``_w4_dot``);
    always NV_POST on the FMA path (``_w4_fma_rows``: fp32 throughout)."""
    if x_ptr.dtype.element_ty == tl.float16 and not FMA:
        return 1.0
    else:
        return NV_POST


NV_PRE = tl.constexpr(18446744073709551616.0)  # 2^64: times the e4m3 block scales (<= 448 * 2^64, no overflow)
NV_POST = tl.constexpr(4611686018427387904.0)  # 2^62: times the sums (2^64 * 2^62 = 2^126 undoes e2m1_values' 2^-126)


@triton.jit
def _w4_dot(a, w_rows, s_rows, z_rows, ks, k_end, n_mask, group,
            NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr,
            RNE: tl.constexpr, BN: tl.constexpr, SUB_K: tl.constexpr, MASK_K: tl.constexpr, SWAP: tl.constexpr):
    """a [BM, SUB_K] (columns ks.., zero past k_end) @ W[:, ks:ks + SUB_K]^T -> fp32 [BM, BN] (SWAP: the transposed
    product W @ a^T [BN, BM], the weight tile as the dot's first operand), int4 group scales
    applied (NVFP4: block scales; not the global multiplier). w_rows [BN, 1]: the rows' word pointers; s_rows /
    z_rows [BN]: the rows' scale / zero pointers (int4: [N, G]; NVFP4: e4m3 [N, K / 16]). RNE: bf16 x under the
    interpreter (SCALE_W tiles rounded to nearest in fp32 first). MASK_K: the tile may reach past k_end (a tail
    step); without it the loads are masked by rows only, so they vectorize (16-byte loads)."""
    kw = tl.max_contiguous(tl.multiple_of(ks // 8 + tl.arange(0, SUB_K // 8), SUB_K // 8), SUB_K // 8)
    if MASK_K:
        words = tl.load(w_rows + kw[None, :], mask=n_mask[:, None] & (kw < k_end // 8)[None, :], other=0)
    else:
        words = tl.load(w_rows + kw[None, :], mask=n_mask[:, None], other=0)
    if NVFP4:
        kg = tl.max_contiguous(tl.multiple_of(ks // 16 + tl.arange(0, SUB_K // 16), SUB_K // 16), SUB_K // 16)
        if MASK_K:
            s_mask = n_mask[:, None] & (kg < k_end // 16)[None, :]
        else:
            s_mask = n_mask[:, None]
        sc = tl.load(s_rows[:, None] + kg[None, :], mask=s_mask, other=0.0).to(tl.float32) * NV_PRE
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, SUB_K // 16, 16]), [BN, SUB_K])
        w = e2m1_values(words, BN, SUB_K) * sc  # e2m1 * scale * 2^-62 (2^-72 .. 2^-50): normal in bf16 / fp32
        if a.dtype == tl.float16:  # fp16 holds e2m1 * scale (2^-10 .. 2688) only unscaled
            w = w * NV_POST
        wt = w.to(a.dtype)  # exact (module doc)
    else:
        gi = tl.minimum(ks, k_end - 1) // group  # a sub-step wholly past K adds 0; keep the scale in bounds
        s = tl.load(s_rows + gi, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_rows + gi, mask=n_mask, other=8).to(tl.float32)
        else:
            z = tl.full([BN], 8.0, tl.float32)
        w = int4_values(words, z[:, None], BN, SUB_K)  # u - zero, exact
        if SCALE_W:
            w = w * s[:, None]
            if RNE:  # the interpreter truncates fp32 -> bf16
                w = _rne_bf16(w)
        wt = w.to(a.dtype)
    if SWAP:
        part = _dot(wt, tl.trans(a), UPCAST)
    else:
        part = _dot(a, tl.trans(wt), UPCAST)
    if not NVFP4 and not SCALE_W:
        if SWAP:
            part = part * s[:, None]
        else:
            part = part * s[None, :]
    return part


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


# ----------------------------------------------------------------------------------------------- dense


@triton.jit
def w4_matmul_kernel(
    x_ptr,  # [R, K], unit stride on K
    w_ptr,  # int32 words [N, K / 8], unit last stride
    s_ptr,  # int4: scales [N, G] (fp32 / bf16 / fp16); NVFP4: e4m3 [N, K / 16]; unit last stride
    z_ptr,  # int4 HAS_ZERO: uint8 zero points [N, G]; else dummy
    g_ptr,  # NVFP4: fp32 [N] global multipliers; else dummy
    y_ptr,  # [R, N], x's dtype, unit last stride
    ws_ptr, lock_ptr,  # SPLIT_K > 1: split-K workspace and counters (_split_k_jit); else dummies
    R, N, K, stride_x, stride_w, stride_s, stride_z, stride_y, GROUP: tl.constexpr,
    NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr,
    RNE_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,  # K per dot: divides BLOCK_K (int4: and the group)
    SPLIT_K: tl.constexpr,  # programs per output tile (grid axis 2), each over a contiguous run of BLOCK_K steps
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
    SWAP_AB: tl.constexpr = False,  # the weight tile as the dots' first operand (``_w4_dot``)
    FMA: tl.constexpr = False,  # fp32 FMAs instead of dots (``_w4_fma_rows``; BLOCK_M any power of two)
):
    """y [R, N] = x [R, K] @ W^T; grid (cdiv(N, BLOCK_N), cdiv(R, BLOCK_M), SPLIT_K). At R <= BLOCK_M (the GEMV
    configs, rows padded to 16 for the dot, or BLOCK_M rows of FMAs) every weight word is read once for all rows."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    pdl_enter(USE_PDL)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < R
    k_start, k_end = split_k_range(K, pid_k, SPLIT_K, BLOCK_K)
    if FMA:
        acc, _ = _w4_fma_rows(x_ptr, rm.to(tl.int64), m_mask, stride_x, w_ptr, stride_w, s_ptr, z_ptr, stride_s,
                              stride_z, rn, n_mask, 0, k_start, k_end, GROUP, False, NVFP4, HAS_ZERO, BLOCK_M, BLOCK_N,
                              BLOCK_K)
    else:
        acc, _ = _w4_mm_rows(x_ptr, rm.to(tl.int64), m_mask, stride_x, w_ptr, stride_w, s_ptr, z_ptr, stride_s,
                             stride_z, rn, n_mask, 0, k_start, k_end, GROUP, False, NVFP4, HAS_ZERO, SCALE_W, UPCAST,
                             RNE_OUT, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, last = split_k_reduce(acc, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K,
                                   BLOCK_M, BLOCK_N)
        mask = split_k_and(mask, last)
    if NVFP4:
        acc = acc * (tl.load(g_ptr + rn, mask=n_mask, other=0.0) * _nv_post(x_ptr, FMA))[None, :]
    if RNE_OUT:
        acc = _rne_bf16(acc)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ routed experts


@triton.jit
def _w4_load_a(a_rows, m_mask, kk, k_end, MASK_K: tl.constexpr):
    if MASK_K:
        return tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & (kk < k_end)[None, :], other=0.0)
    else:
        return tl.load(a_rows + kk[None, :], mask=m_mask[:, None], other=0.0)


@triton.jit
def _w4_step(acc_g, acc_u, a_rows, m_mask, wg_rows, wu_rows, sg_rows, su_rows, zg_rows, zu_rows, k0, k_end, n_mask,
             group, GATED: tl.constexpr, NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_W: tl.constexpr,
             UPCAST: tl.constexpr, RNE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SUB_K: tl.constexpr, MASK_K: tl.constexpr, SWAP: tl.constexpr):
    """One BLOCK_K step of ``_w4_mm_rows`` at k0: BLOCK_K / SUB_K dots per weight."""
    for j in tl.static_range(BLOCK_K // SUB_K):
        ks = k0 + j * SUB_K
        kk = tl.max_contiguous(tl.multiple_of(ks + tl.arange(0, SUB_K), SUB_K), SUB_K)  # ks: a multiple of SUB_K
        a = _w4_load_a(a_rows, m_mask, kk, k_end, MASK_K)
        acc_g += _w4_dot(a, wg_rows, sg_rows, zg_rows, ks, k_end, n_mask, group, NVFP4, HAS_ZERO, SCALE_W, UPCAST,
                         RNE, BLOCK_N, SUB_K, MASK_K, SWAP)
        if GATED:
            acc_u += _w4_dot(a, wu_rows, su_rows, zu_rows, ks, k_end, n_mask, group, NVFP4, HAS_ZERO, SCALE_W,
                             UPCAST, RNE, BLOCK_N, SUB_K, MASK_K, SWAP)
    return acc_g, acc_u


@triton.jit
def _w4_mm_rows(
    a_ptr, arow, m_mask, stride_ar,  # A rows arow [BM] (int64) of a [*, K]
    w_ptr, stride_wn,  # the weight's words [N_w, K / 8]
    s_ptr, z_ptr, stride_sn, stride_zn,  # its scales (and int4 zero points)
    rn, n_mask, N_UP, k_start, k_end, group,  # output columns [BN] (the up half N_UP rows further, GATED)
    GATED: tl.constexpr, NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr,
    RNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    SWAP: tl.constexpr = False,  # swapped dots (``_w4_dot``): accumulators [BN, BM], transposed once at the end
):
    """(acc_gate, acc_up) [BM, BN] fp32 = A @ W[rn]^T (and A @ W[N_UP + rn]^T when GATED) over k_start:k_end
    (k_start a multiple of BLOCK_K): whole BLOCK_K steps without K masks, then one masked tail step."""
    if SWAP:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_rows = a_ptr + arow[:, None] * stride_ar
    rg = rn.to(tl.int64)
    ru = (rn + N_UP).to(tl.int64)
    wg_rows = w_ptr + rg[:, None] * stride_wn
    wu_rows = w_ptr + ru[:, None] * stride_wn
    k_full = k_start + (k_end - k_start) // BLOCK_K * BLOCK_K
    for k0 in range(k_start, k_full, BLOCK_K):
        acc_g, acc_u = _w4_step(acc_g, acc_u, a_rows, m_mask, wg_rows, wu_rows, s_ptr + rg * stride_sn,
                                s_ptr + ru * stride_sn, z_ptr + rg * stride_zn, z_ptr + ru * stride_zn, k0, k_end,
                                n_mask, group, GATED, NVFP4, HAS_ZERO, SCALE_W, UPCAST, RNE, BLOCK_N, BLOCK_K, SUB_K,
                                False, SWAP)
    if k_full < k_end:
        acc_g, acc_u = _w4_step(acc_g, acc_u, a_rows, m_mask, wg_rows, wu_rows, s_ptr + rg * stride_sn,
                                s_ptr + ru * stride_sn, z_ptr + rg * stride_zn, z_ptr + ru * stride_zn, k_full, k_end,
                                n_mask, group, GATED, NVFP4, HAS_ZERO, SCALE_W, UPCAST, RNE, BLOCK_N, BLOCK_K, SUB_K,
                                True, SWAP)
    if SWAP:  # one return statement (Triton refuses returns of different shapes, even under a constexpr if)
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    return acc_g, acc_u


@triton.jit
def _w4_global(acc_g, acc_u, g_ptr, a_ptr, expert, stride_ge, GATED: tl.constexpr, NVFP4: tl.constexpr,
               DIVIDE_G: tl.constexpr, FMA: tl.constexpr = False):
    """NVFP4: the accumulators times the expert's global multipliers g [E, 1 + GATED] (divided by them with
    DIVIDE_G: compressed-tensors' weight_global_scale) and ``_nv_post(a_ptr, FMA)``; int4: unchanged."""
    if NVFP4:
        UP: tl.constexpr = 1 if GATED else 0
        gg = tl.load(g_ptr + expert * stride_ge)
        gu = tl.load(g_ptr + expert * stride_ge + UP)
        post = _nv_post(a_ptr, FMA)
        if DIVIDE_G:
            acc_g = acc_g * (post / gg)
            acc_u = acc_u * (post / gu)
        else:
            acc_g = acc_g * (gg * post)
            acc_u = acc_u * (gu * post)
    return acc_g, acc_u


@triton.jit
def w4_moe_gemv_kernel(
    a_ptr,  # GATED: x [R, H]; else the activations [P, I]; unit last stride
    w_ptr,  # int32 words, GATED: [E, 2I, H / 8]; else [E, H, I / 8]; unit last stride
    s_ptr, z_ptr,  # int4: scales [E, N_w, G] (+ uint8 zeros, same strides); NVFP4: e4m3 [E, N_w, K / 16]
    g_ptr,  # NVFP4: fp32 [E, 1 + GATED] global multipliers (gate, up); else dummy
    c_ptr,  # out [P, N] contiguous, a's dtype
    ids_ptr,  # [P] flattened topk_ids
    ws_ptr, lock_ptr,  # SPLIT_K > 1: split-K workspace, (1 + GATED) tiles per (pair, N tile), and counters
    P, N, K, A_ROW_DIV, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_ge, GROUP: tl.constexpr, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr,
    DIVIDE_G: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr = False, SWAP_AB: tl.constexpr = False, FMA: tl.constexpr = False,
):
    """The small path (``_moe_jit.moe_gemv_kernel``'s scheme on 4-bit weights): program per (pair, N tile, K split);
    the first pair of each expert gathers all pairs routed to it into BLOCK_R dot rows (FMA: BLOCK_R rows of fp32
    FMAs, ``_w4_fma_rows``) and streams the expert's words once for each BLOCK_R of them, the other programs exit
    at once."""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    pdl_enter(USE_PDL)
    q = tl.arange(0, P_PAD)
    eid = tl.load(ids_ptr + q, mask=q < P, other=-1)
    mine = tl.load(ids_ptr + p)
    member = (eid == mine) & (q < P)
    first = tl.min(tl.where(member, q, P_PAD), axis=0)
    if first == p:
        count = tl.sum(member.to(tl.int32), axis=0)
        rank = tl.cumsum(member.to(tl.int32), axis=0) - 1
        expert = mine.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        sl = tl.arange(0, BLOCK_R)
        k_start, k_end = split_k_range(K, pid_k, SPLIT_K, BLOCK_K)
        for c0 in range(0, count, BLOCK_R):
            match = member[None, :] & (rank[None, :] == (c0 + sl)[:, None])  # [BLOCK_R, P_PAD]
            pair = tl.sum(tl.where(match, q[None, :], 0), axis=1)
            m_mask = (c0 + sl) < count
            arow = (pair // A_ROW_DIV).to(tl.int64)
            if FMA:
                acc_g, acc_u = _w4_fma_rows(
                    a_ptr, arow, m_mask, stride_ar, w_ptr + expert * stride_we, stride_wn, s_ptr + expert * stride_se,
                    z_ptr + expert * stride_se, stride_sn, stride_sn, rn, n_mask, N, k_start, k_end, GROUP,
                    GATED, NVFP4, HAS_ZERO, BLOCK_R, BLOCK_N, BLOCK_K)
            else:
                acc_g, acc_u = _w4_mm_rows(
                    a_ptr, arow, m_mask, stride_ar, w_ptr + expert * stride_we, stride_wn, s_ptr + expert * stride_se,
                    z_ptr + expert * stride_se, stride_sn, stride_sn, rn, n_mask, N, k_start, k_end, GROUP,
                    GATED, NVFP4, HAS_ZERO, SCALE_W, UPCAST, RNE_BF16, BLOCK_R, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB)
            acc_g, acc_u = _w4_global(acc_g, acc_u, g_ptr, a_ptr, expert, stride_ge, GATED, NVFP4, DIVIDE_G, FMA)
            if SPLIT_K > 1:
                tile = tl.sum(tl.where(sl == 0, pair, 0), axis=0) * tl.num_programs(1) + pid_n
                NACC: tl.constexpr = 2 if GATED else 1
                split_k_store(acc_g, ws_ptr, (tile * SPLIT_K + pid_k) * NACC, BLOCK_R, BLOCK_N)
                if GATED:
                    split_k_store(acc_u, ws_ptr, (tile * SPLIT_K + pid_k) * NACC + 1, BLOCK_R, BLOCK_N)
                last = split_k_arrive(lock_ptr, tile, SPLIT_K)
                acc_g = split_k_sum(ws_ptr, tile * SPLIT_K * NACC, last, SPLIT_K, NACC, BLOCK_R, BLOCK_N)
                if GATED:
                    acc_u = split_k_sum(ws_ptr, tile * SPLIT_K * NACC + 1, last, SPLIT_K, NACC, BLOCK_R, BLOCK_N)
                m_mask = split_k_and(m_mask, last)
            _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                      c_ptr, False)  # no LoRA delta: 4-bit experts with adapters run the float kernels


@triton.jit(do_not_specialize=["P"])  # step-varying counts: one variant (sparrow.engine.warmup)
def w4_moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, g_ptr, c_ptr,  # as w4_moe_gemv_kernel
    sorted_ptr,  # [S] int32 sorted pair ids, P = padding (moe_align)
    block_expert_ptr,  # [NB] int32 expert of each block
    total_ptr,  # [1] int32 padded pair count
    P, N, K, A_ROW_DIV, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_ge, GROUP: tl.constexpr, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr,
    DIVIDE_G: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    USE_PDL: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
):
    """The grouped path (``_moe_jit.moe_gemm_kernel``'s scheme on 4-bit weights): program per (block of BLOCK_M
    sorted pairs, BLOCK_N outputs); each block reads only its expert's words."""
    pdl_enter(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    total = tl.load(total_ptr)
    if pid_m * BLOCK_M < total:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = pair < P
        arow = (pair // A_ROW_DIV).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        acc_g, acc_u = _w4_mm_rows(
            a_ptr, arow, m_mask, stride_ar, w_ptr + expert * stride_we, stride_wn, s_ptr + expert * stride_se,
            z_ptr + expert * stride_se, stride_sn, stride_sn, rn, n_mask, N, 0, K, GROUP,
            GATED, NVFP4, HAS_ZERO, SCALE_W, UPCAST, RNE_BF16, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB)
        acc_g, acc_u = _w4_global(acc_g, acc_u, g_ptr, a_ptr, expert, stride_ge, GATED, NVFP4, DIVIDE_G)
        _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                  c_ptr, False)  # no LoRA delta: 4-bit experts with adapters run the float kernels


# ------------------------------------------------------------------------------------------- dequantize


@triton.jit
def w4_dequant_kernel(
    w_ptr,  # int32 words [ROWS, K / 8] (rows of one weight, or of stacked experts [E * N]); unit last stride
    s_ptr,  # int4: scales [ROWS, G]; NVFP4: e4m3 [ROWS, K / 16]
    z_ptr,  # int4 HAS_ZERO: uint8 zero points [ROWS, G]; else dummy
    g_ptr,  # NVFP4 HAS_G: fp32 global multipliers, one per G_ROWS consecutive rows; else dummy
    out_ptr,  # [ROWS, K] in the output dtype, unit last stride
    ROWS, K, stride_wr, stride_sr, stride_or, G_ROWS, GROUP: tl.constexpr,
    NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_G: tl.constexpr, DIVIDE_G: tl.constexpr,
    RNE_S: tl.constexpr, RNE_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The weight in float, as the twins compute it (``int4.dequantize_int4_ref``: (u - zero) * scale in fp32,
    rounded to the scale dtype, then to the output's; ``nvfp4.dequantize_nvfp4_ref``: e2m1 * (scale * global)
    (or / global with DIVIDE_G) in fp32, rounded to the output's dtype): program per (BLOCK_R rows, BLOCK_K
    columns); int4 BLOCK_K divides GROUP. RNE_S / RNE_OUT: bf16 scales / output under the interpreter (its fp32 ->
    bf16 casts truncate)."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rr = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_mask = rr < ROWS
    kw = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + rr[:, None] * stride_wr + kw[None, :], mask=r_mask[:, None] & (kw < K // 8)[None, :],
                    other=0)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = r_mask[:, None] & (kk < K)[None, :]
    if NVFP4:
        kg = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        sc = tl.load(s_ptr + rr[:, None] * stride_sr + kg[None, :],
                     mask=r_mask[:, None] & (kg < K // 16)[None, :], other=0.0).to(tl.float32)
        if HAS_G:
            g = tl.load(g_ptr + rr // G_ROWS, mask=r_mask, other=1.0)
            if DIVIDE_G:
                sc = sc / g[:, None]
            else:
                sc = sc * g[:, None]
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_R, BLOCK_K // 16, 16]), [BLOCK_R, BLOCK_K])
        w = e2m1_values(words, BLOCK_R, BLOCK_K) * NV_PRE * NV_POST * sc  # e2m1 exactly, times its scale
    else:
        gi = (pid_k * BLOCK_K) // GROUP
        s = tl.load(s_ptr + rr * stride_sr + gi, mask=r_mask, other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + rr * stride_sr + gi, mask=r_mask, other=8).to(tl.float32)
        else:
            z = tl.full([BLOCK_R], 8.0, tl.float32)
        w = int4_values(words, z[:, None], BLOCK_R, BLOCK_K) * s.to(tl.float32)[:, None]
        if RNE_S:
            w = _rne_bf16(w)
        w = w.to(s.dtype).to(tl.float32)
    if RNE_OUT:
        w = _rne_bf16(w)
    tl.store(out_ptr + rr[:, None] * stride_or + kk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
