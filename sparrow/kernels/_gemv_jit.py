"""Triton body of the small-row GEMV (launcher and torch twin: ``sparrow.kernels.gemv``).

Shapes: R = rows (<= 16), K = input width, N = output width; x [R, K], w [N, K] (row-major, the
nn.Linear layout), y [R, N]; FP8 weights carry block scales s [ceil(N/128), ceil(K/128)] fp32.
One program owns BLOCK_N output columns for *all* R rows and walks K in BLOCK_K steps, so each weight
element is read from memory exactly once per call (decode is bound by those bytes). FP8 weights are W8A16 by
default (e4m3 widened to x's dtype); the A8 variant is W8A8 (x quantized per 128-group in the kernel, the
numbers of ``sparrow.kernels.fp8_gemm``), so the dot can run on e4m3 tensor cores.
"""
import triton
import triton.language as tl

from sparrow.kernels._fp8_gemm_jit import _round_e4m3


@triton.jit
def gemv_kernel(
    x_ptr,  # [R, K], unit stride on K
    w_ptr,  # [N, K], unit stride on K; x's dtype, or e4m3 when FP8_W
    s_ptr,  # [ceil(N/128), ceil(K/128)] fp32 contiguous, or dummy when not FP8_W
    y_ptr,  # [R, N] contiguous, x's dtype
    R,
    N,
    K,
    stride_xr,
    stride_wn,
    stride_sn,
    FP8_W: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor-core tl.dot on a [BLOCK_R >= 16, BLOCK_K] x [BLOCK_K, BLOCK_N] tile
    SWAP_AB: tl.constexpr,  # with USE_DOT: y^T = w @ x^T, the weight tile as the K-major A operand (converted
    # from e4m3 in registers) and the rows as the N side of the dot; acc is [BLOCK_N, BLOCK_R]
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products in tl.dot, not tf32
    A8: tl.constexpr,  # with FP8_W and USE_DOT: W8A8, x quantized per 128-group here and an e4m3 x e4m3 dot
    INTERPRET: tl.constexpr,  # with A8 under TRITON_INTERPRET: e4m3 rounding emulated, dot on fp32 values
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K elements per loop step
    SUB_K: tl.constexpr,  # K per tl.dot inside a step: divides 128 when FP8_W (one scale block each)
):
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, SUB_K)
    r_mask = rr < R
    n_mask = rn < N
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + j * SUB_K
            kk = ks + rk
            k_mask = kk < K
            x = tl.load(x_ptr + rr[:, None] * stride_xr + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if A8:
                # fp8.quantize_fp8_per_group_ref's numbers (SUB_K == 128: one group per sub-step; masked
                # columns are 0, so a ragged last group's amax covers its valid columns only)
                xf = x.to(tl.float32)
                x_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-10),
                                     tl.full([BLOCK_R], 448.0, tl.float32))
                xq = tl.minimum(tl.maximum(tl.math.div_rn(xf, x_s[:, None]), -448.0), 448.0)
                if INTERPRET:
                    x = _round_e4m3(xq)
                    w = w.to(tl.float32)
                else:
                    x = xq.to(tl.float8e4nv)
            elif FP8_W:
                w = w.to(x.dtype)  # e4m3 -> bf16 / fp16 / fp32 is exact; the block scale is applied per SUB_K
            if SWAP_AB:
                if IEEE:
                    part = tl.dot(w, tl.trans(x), input_precision="ieee")
                else:
                    part = tl.dot(w, tl.trans(x))
            elif USE_DOT:
                if IEEE:
                    part = tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(w))
            else:
                part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            if FP8_W:
                # a sub-step wholly past K (part = 0) reads the last scale column instead of out of bounds
                s = tl.load(s_ptr + (rn // 128) * stride_sn + tl.minimum(ks, K - 1) // 128, mask=n_mask, other=0.0)
                if SWAP_AB:
                    part = part * s[:, None]
                    if A8:
                        part = part * x_s[None, :]
                else:
                    part = part * s[None, :]
                    if A8:
                        part = part * x_s[:, None]
            acc += part
    if SWAP_AB:
        tl.store(y_ptr + rr[None, :] * N + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=r_mask[None, :] & n_mask[:, None])
    else:
        tl.store(y_ptr + rr[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])
