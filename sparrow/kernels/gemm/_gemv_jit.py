"""Triton body of the small-row GEMV (launcher and torch twin: ``sparrow.kernels.gemm.gemv``).

Shapes: R = rows (<= 16), K = input width, N = output width; x [R, K], w [N, K] (row-major, the
nn.Linear layout), y [R, N]; FP8 weights carry block scales s [ceil(N/128), ceil(K/128)] fp32.
One program owns BLOCK_N output columns for *all* R rows and walks its K range in BLOCK_K steps, so each
weight element is read from memory exactly once per call (decode is bound by those bytes); with SPLIT_K > 1
the K range is split over programs and reduced in the kernel (``_split_k_jit``). FP8 weights are W8A16
(e4m3 widened to x's dtype, exact), or W8A8 with QUANT_X (x quantized per 128-column group in registers,
e4m3 tensor-core dots). The inner products are tensor-core ``tl.dot`` with the rows padded to 16.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import dot_upcast, quant_fp8
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_range, split_k_reduce


@triton.jit
def gemv_kernel(
    x_ptr,  # [R, K], unit stride on K
    w_ptr,  # [N, K], unit stride on K; x's dtype, or e4m3 when FP8_W
    s_ptr,  # [ceil(N/128), ceil(K/128)] fp32 contiguous, or dummy when not FP8_W
    y_ptr,  # [R, N] contiguous, x's dtype
    ws_ptr,  # SPLIT_K > 1: fp32 partials, SPLIT_K * BLOCK_R * BLOCK_N per N tile (_split_k_jit); else dummy
    lock_ptr,  # SPLIT_K > 1: int32 [N tiles] counters, 0 on entry and on exit; else dummy
    R,
    N,
    K,
    stride_xr,
    stride_wn,
    stride_sn,
    FP8_W: tl.constexpr,
    SWAP_AB: tl.constexpr,  # y^T = w @ x^T, the weight tile as the K-major A operand (converted
    # from e4m3 in registers) and the rows as the N side of the dot; acc is [BLOCK_N, BLOCK_R]
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products in tl.dot, not tf32
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K elements per loop step
    SUB_K: tl.constexpr,  # K per inner product inside a step: divides 128 when FP8_W (one scale block each)
    SPLIT_K: tl.constexpr,  # programs per N tile (grid axis 1), each over a contiguous run of BLOCK_K steps
    QUANT_X: tl.constexpr = False,  # FP8_W: W8A8, x quantized per row and 128-column group in
    # registers (SUB_K = 128) and the dot run on e4m3 tensor cores
    EMULATE_FP8: tl.constexpr = False,  # QUANT_X under the interpreter: e4m3 rounding emulated, fp32 dots (_fp8_jit)
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_enter(USE_PDL)
    rr = tl.arange(0, BLOCK_R)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, SUB_K)
    r_mask = rr < R
    n_mask = rn < N
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    k_start, k_end = split_k_range(K, pid_k, SPLIT_K, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + j * SUB_K
            kk = ks + rk
            k_mask = kk < k_end
            x = tl.load(x_ptr + rr[:, None] * stride_xr + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if FP8_W:
                # a sub-step wholly past K (w = 0) reads the last scale column instead of out of bounds
                s = tl.load(s_ptr + (rn // 128) * stride_sn + tl.minimum(ks, k_end - 1) // 128, mask=n_mask, other=0.0)
            if QUANT_X:
                xq, xs = quant_fp8(x.to(tl.float32), EMULATE_FP8)
                if SWAP_AB:
                    acc += dot_upcast(w, tl.trans(xq), EMULATE_FP8) * (s[:, None] * xs[None, :])
                else:
                    acc += dot_upcast(xq, tl.trans(w), EMULATE_FP8) * (xs[:, None] * s[None, :])
            else:
                if FP8_W:
                    w = w.to(x.dtype)  # e4m3 -> bf16 / fp16 / fp32 is exact; the block scale is applied per SUB_K
                if SWAP_AB:
                    if IEEE:
                        part = tl.dot(w, tl.trans(x), input_precision="ieee")
                    else:
                        part = tl.dot(w, tl.trans(x))
                    if FP8_W:
                        part = part * s[:, None]
                else:
                    if IEEE:
                        part = tl.dot(x, tl.trans(w), input_precision="ieee")
                    else:
                        part = tl.dot(x, tl.trans(w))
                    if FP8_W:
                        part = part * s[None, :]
                acc += part
    if SWAP_AB:
        y_ptrs = y_ptr + rr[None, :] * N + rn[:, None]
        y_mask = r_mask[None, :] & n_mask[:, None]
        BM: tl.constexpr = BLOCK_N
        BN: tl.constexpr = BLOCK_R
    else:
        y_ptrs = y_ptr + rr[:, None] * N + rn[None, :]
        y_mask = r_mask[:, None] & n_mask[None, :]
        BM: tl.constexpr = BLOCK_R
        BN: tl.constexpr = BLOCK_N
    if SPLIT_K > 1:
        acc, last = split_k_reduce(acc, ws_ptr, lock_ptr, pid, pid_k, SPLIT_K, BM, BN)
        y_mask = split_k_and(y_mask, last)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
