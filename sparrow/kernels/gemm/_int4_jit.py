"""Triton bodies of the dense 4-bit weight kernels, int4 W4A16 and NVFP4 W4A16: the linear ``w4_matmul_kernel``
and ``w4_dequant_kernel`` (launchers: ``sparrow.kernels.gemm.int4``, ``sparrow.kernels.gemm.nvfp4_linear``). The
decoders and the dot steps: ``_w4_jit``; the FMA rows: ``_w4_fma_jit``; the routed experts:
``sparrow.kernels.moe._w4_moe_jit``.

Shapes: R = rows, N = output width, K = input width (``_w4_jit`` for the formats and tiles).
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import rne_bf16 as _rne_bf16
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_range, split_k_reduce
from sparrow.kernels.gemm._w4_fma_jit import _w4_fma_rows
from sparrow.kernels.gemm._w4_jit import NV_POST, NV_PRE, _nv_post, _w4_mm_rows, e2m1_values, int4_values


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
