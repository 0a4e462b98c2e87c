"""Triton helpers of the 4-bit weight kernels, int4 W4A16 and NVFP4 W4A16: the decoders and the dot steps (the
kernels: ``_int4_jit`` dense and dequantize, ``_w4_fma_jit`` the FMA GEMV rows, ``sparrow.kernels.moe._w4_moe_jit``
the routed experts; launchers: ``sparrow.kernels.gemm.int4``, ``sparrow.kernels.gemm.nvfp4_linear``,
``sparrow.kernels.moe.int4_moe``, ``sparrow.kernels.moe.nvfp4_moe``).

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
BN = 64). FMA (``_w4_fma_jit._w4_fma_rows``, GEMVs of 1, 2 or 4 rows): no dots; the decoded tile (fp32, column order) times
each row's x step (contiguous 16-byte loads) in fp32, summed per step, with the next step's words and scales
loaded during the current one. Accumulation is fp32; outputs are rounded once to x's dtype. UPCAST / RNE_OUT: the
interpreter's workarounds (``_fp8_jit``: dots on exactly widened fp32 operands, bf16 outputs rounded to nearest).
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import dot_upcast as _dot, rne_bf16 as _rne_bf16


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
