"""Triton body of the standalone activation quantizer (launcher and torch twin: ``sparrow.kernels.gemm.scaled_mm``).

Shapes: M = rows, K = columns, G = ceil(K / 128) groups, M_pad >= M rows written (rows past M get q = 0).
One program quantizes BLOCK_M rows of one 128-column group with ``_fp8_jit.quant_fp8`` (the numbers of
``fp8.quantize_fp8_per_group_ref``) and writes q row-major and the scale at s_ptr + g * stride_sg + m *
stride_sm, so the launcher picks the scale layout (cuBLAS's 1 x 128 block scaling wants it M-major).
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import quant_fp8
from sparrow.kernels.common._pdl_jit import pdl_enter


@triton.jit(do_not_specialize=["M", "M_pad", "stride_sg"])  # step-varying counts: one variant (sparrow.engine.warmup)
def quant_fp8_groups_kernel(
    x_ptr,  # [M, K] float, unit stride on K
    q_ptr,  # [M_pad, K] e4m3 (fp32 holding e4m3 values when EMULATE_FP8), unit stride on K
    s_ptr,  # [G, M_pad] or [M_pad, G] fp32 (strides below)
    M,
    M_pad,
    K,
    stride_xm,
    stride_qm,
    stride_sg,
    stride_sm,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,  # 128
    EMULATE_FP8: tl.constexpr = False,  # interpreter: e4m3 rounding in fp32 arithmetic (_fp8_jit)
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # the MoE intermediate: P x I > 2^31
    g = tl.program_id(1)
    rk = g * GROUP + tl.arange(0, GROUP)
    k_mask = rk < K
    a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & k_mask[None, :],
                other=0.0).to(tl.float32)
    q, scale = quant_fp8(a, EMULATE_FP8)
    out = rm < M_pad
    tl.store(q_ptr + rm[:, None] * stride_qm + rk[None, :], q, mask=out[:, None] & k_mask[None, :])
    tl.store(s_ptr + g * stride_sg + rm * stride_sm, scale, mask=out)
