"""Triton body of the block-scaled FP8 GEMM (launcher and torch twin: ``sparrow.kernels.gemm.fp8_gemm``).

Shapes: M = rows, K = input width, N = output width; a [M, K] (bf16 / fp16 / fp32), w [N, K] e4m3 (row-major, nn.Linear
layout) with block scales w_s [ceil(N/128), ceil(K/128)] fp32, c [M, N].

    c[m, n] = sum over 128-wide k groups g of  a_s[m, g] * w_s[n // 128, g] * (a_q[m, g] . w_q[n, g])

Each program owns a [BLOCK_M, BLOCK_N] tile of c and walks K in steps of BLOCK_K = 128 (one scale group
per step, as in DeepSeek-V3's ``w8a8_block_fp8_matmul``). The program quantizes its a tile (a_q, a_s)
per row and 128-column group itself (scale = max(amax, 1e-10) / 448, q = clamp(a / scale) -> e4m3, the
formula of ``sparrow.kernels.gemm.fp8.quantize_fp8_per_group_ref``), so no second pass over a is needed.

INTERPRET: the Triton 3.9 interpreter rounds fp32 -> e4m3 wrongly when the rounding carries into the
exponent (127.7 -> 64) and feeds 8/16-bit dot operands badly, so there the e4m3 rounding is emulated in
fp32 bit arithmetic and the dot runs on fp32 values (same numbers, exact products). On the GPU the cast is
``cvt.rn.satfinite`` and ``tl.dot`` runs on e4m3 tensor cores (Hopper wgmma / Ada mma) with fp32 accumulate.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import round_e4m3
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_range, split_k_reduce


@triton.jit(do_not_specialize=["M"])  # step-varying counts: one variant (sparrow.engine.warmup)
def fp8_gemm_kernel(
    a_ptr,  # [M, K] float, unit stride on K
    w_ptr,  # [N, K] e4m3, unit stride on K
    ws_ptr,  # [ceil(N/128), ceil(K/128)] fp32, unit stride on K groups
    c_ptr,  # [M, N] contiguous
    part_ptr,  # SPLIT_K > 1: fp32 partials, SPLIT_K * BLOCK_M * BLOCK_N per output tile (_split_k_jit); else dummy
    lock_ptr,  # SPLIT_K > 1: int32 [output tiles] counters, 0 on entry and on exit; else dummy
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_wsn,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # must be 128: one scale group per step
    GROUP_M: tl.constexpr,  # programs of GROUP_M row tiles sweep N together (L2 reuse of w)
    SPLIT_K: tl.constexpr,  # programs per output tile (grid axis 1), each over a contiguous run of K groups
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_end = split_k_range(K, pid_k, SPLIT_K, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < k_end
        g = k0 // BLOCK_K
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        af = a.to(tl.float32)
        a_s = tl.maximum(tl.max(tl.abs(af), axis=1), 1e-10)
        a_s = tl.math.div_rn(a_s, tl.full([BLOCK_M], 448.0, tl.float32))
        aq = tl.math.div_rn(af, a_s[:, None])
        aq = tl.minimum(tl.maximum(aq, -448.0), 448.0)
        if INTERPRET:
            aq = round_e4m3(aq)
        else:
            aq = aq.to(tl.float8e4nv)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w_s = tl.load(ws_ptr + (rn // 128) * stride_wsn + g, mask=n_mask, other=0.0)
        if INTERPRET:
            part = tl.dot(aq, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(aq, tl.trans(w))
        acc += part * a_s[:, None] * w_s[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, last = split_k_reduce(acc, part_ptr, lock_ptr, pid, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)
        c_mask = split_k_and(c_mask, last)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)
