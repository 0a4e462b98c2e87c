"""Triton body of the dense GGUF linear (launcher and torch twin: ``sparrow.kernels.gemm.gguf``).

Shapes: R = rows, N = output width, K = input width (a multiple of the type's block B); x [R, K] (unit stride on
K), qweight uint8 [N, K // B * T] (each row its GGUF blocks as in the file: ``_gguf_dequant_jit``), y [R, N].

One kernel, three tile shapes (constexpr), all with the weight rows as the tile's first side: acc [BLOCK_N,
BLOCK_M] fp32, one program per (BLOCK_N rows of the weight, BLOCK_M rows of x, K range).
- FMA GEMV (decode, R <= 4): each K step decodes a [BLOCK_N, BLOCK_K] weight tile in registers
  (``dequant_tile``: whole 32-element groups, each group's bytes one contiguous run, its scales decoded once),
  rounds it to x's dtype (the twin's weight) and multiplies it by the BLOCK_M rows of x in fp32 FMAs, summed
  along K in registers: no MMA padding of the rows, no layout conversion of the decoded tile.
- dot GEMV (R <= 16, speculative verify): the decoded tile in x's dtype is the A operand of a tensor-core
  ``tl.dot`` against x^T padded to 16 columns ("swap AB": the weight fills the MMA's M side).
- GEMM (R > 16, prefill): the same swapped dot on BLOCK_M = 64.. rows of x per program, the weight tile decoded
  once per (M tile, step) in registers.
A row's bytes are read once per M tile; with one M tile (GEMV) every weight byte is read once per call. SPLIT_K
> 1 splits the K steps over programs and reduces them in the kernel (``_split_k_jit``): N = 2816 or 4096 in
tiles of 32 gives too few programs for an H100's 132 SMs otherwise. Accumulation is fp32; y is rounded once
to x's dtype. Interpreter workarounds (``_fp8_jit``): UPCAST (the dot on exactly widened fp32 operands, the
interpreter misreads bf16 dots) and RNE (fp32 -> bf16 by ``rne_bf16``, its cast truncates).

To tune on the GPU (not done: no GPU here). The sm_90 build (ptxas, Triton 3.9) of GGUF_CONFIGS has no register
spills (Q4_K's dot GEMV: 16 bytes of stack) and no FMA contraction in the decoders, but every weight byte is an
``ld.global.b8``: Triton cannot prove the runs' alignment (group offsets come from a reduction over offs_k), so
the loads are not vectorized. First item: read the qs runs as int32 words (K-quants: 144 / 176 / 84-byte blocks
keep 4-byte alignment when qweight's pointer and row bytes do; Q8_0 / Q4_0 / Q5_0 / Q6_K / Q3_K blocks are only
2-byte aligned: 16-bit words) with ``tl.multiple_of`` hints and a launcher check. Then per type and R: BLOCK_N /
BLOCK_K / num_warps / split-K of the FMA GEMV (bytes per step: BLOCK_N x BLOCK_K / B x T), the R bound between
FMA and dot GEMV, num_stages, and the GEMM tile (``gguf.GGUF_CONFIGS``, or a card's ``gguf.config_file``).
Seen on an H100 (Triton 3.6, benchmarks/gguf_gemv_sweep.py): the Triton 3.6 and 3.9 sm_90 builds already read
Q4_K's qs as LDG.E.128 and Q8_0 / Q6_K as 16-bit loads (sass_report-style count); Q6_K's R = 1 time fell 1.7x with
8-row tiles (``gguf.GEMV1_BY_TYPE``); at 4096 x 4096 and below, eager calls are bound by the host (a 0.9 MB Q5_0
weight takes ~100 us a call, ~27 us of it sparrow's Python launcher), so time those under a CUDA graph.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import dot_upcast, rne_bf16
from sparrow.kernels.common._gguf_dequant_jit import dequant_tile
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_range, split_k_reduce


@triton.jit
def _weight_as_x(w, x_dtype: tl.constexpr, RNE: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 decoded tile rounded to x's dtype (round to nearest even), as the dot / FMA operand: fp32
    holding the rounded values when UPCAST or RNE (interpreter), else x's dtype."""
    if RNE:
        return rne_bf16(w)
    elif UPCAST:
        return w.to(x_dtype).to(tl.float32)
    else:
        return w.to(x_dtype)


@triton.jit
def gguf_matmul_kernel(
    x_ptr,  # [R, K], unit stride on K; fp32 / bf16 / fp16
    w_ptr,  # uint8 [N, K // B * T], GGUF blocks
    b_ptr,  # [N] bias in any float dtype, or dummy when not HAS_BIAS
    y_ptr,  # [R, N] contiguous, x's dtype
    ws_ptr,  # SPLIT_K > 1: fp32 partials (_split_k_jit); else dummy
    lock_ptr,  # SPLIT_K > 1: int32 [N tiles] counters; else dummy
    R,
    N,
    K,
    stride_xr,
    stride_wn,  # bytes per weight row
    GGML_TYPE: tl.constexpr,  # gguf.GGMLQuantizationType value
    HAS_BIAS: tl.constexpr,
    FMA: tl.constexpr,  # fp32 FMAs instead of a dot (BLOCK_M 1..4 rows)
    UPCAST: tl.constexpr,  # dot on fp32 operands (fp32 x, or the interpreter)
    RNE: tl.constexpr,  # interpreter, bf16 x: weight and output rounded by rne_bf16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    SPLIT_K: tl.constexpr,  # programs per N tile (grid axis 2, with one M tile)
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    """y [R, N] = x [R, K] @ W^T (+ bias) for a GGUF weight; grid (cdiv(N, BLOCK_N), cdiv(R, BLOCK_M), SPLIT_K).
    With one M tile (the GEMV configs) every weight byte is read once for all rows."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    pdl_enter(USE_PDL)
    rk = tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < R
    row_off = tl.minimum(rn, N - 1).to(tl.int64) * stride_wn
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xr
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start, k_end = split_k_range(K, pid_k, SPLIT_K, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < k_end
        w = _weight_as_x(dequant_tile(w_ptr, row_off, kk % K, GGML_TYPE), x_ptr.dtype.element_ty, RNE, UPCAST or FMA)
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if FMA:
            acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
        else:
            acc += dot_upcast(w, tl.trans(x), UPCAST)
    y_ptrs = y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
    y_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K > 1:
        acc, last = split_k_reduce(acc, ws_ptr, lock_ptr, pid_n, pid_k, SPLIT_K, BLOCK_N, BLOCK_M)
        y_mask = split_k_and(y_mask, last)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if RNE:
        acc = rne_bf16(acc)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
