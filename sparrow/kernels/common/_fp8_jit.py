"""Triton helpers shared by the kernels that quantize activations to e4m3 in registers (the MoE experts,
the small-row GEMV in W8A8 mode).

``quant_fp8`` gives the numbers of ``sparrow.kernels.gemm.fp8.quantize_fp8_per_group_ref``: per row of a
[M, 128] group, scale = max(amax, 1e-10) / 448, q = clamp(a / scale, -448, 448) rounded to e4m3.

Triton 3.9's interpreter reads bf16 ``tl.dot`` operands as raw integers, rounds fp32 -> e4m3 wrongly
across binades and truncates fp32 -> bf16, so under TRITON_INTERPRET the launchers set UPCAST (dots in
fp32 on exactly widened operands), EMULATE_FP8 (e4m3 rounding in fp32 arithmetic, ties to even) and
RNE_BF16 (round to bf16 in fp32 before the store); the GPU uses tl.dot and the hardware conversions.
"""
import triton
import triton.language as tl


@triton.jit
def dot_upcast(a, b, UPCAST: tl.constexpr):
    """a [M, Kb] @ b [Kb, N] -> fp32. UPCAST: through an exact fp32 dot (interpreter, fp32 operands)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def round_e4m3(v):
    """Nearest e4m3 value (ties to even) of fp32 v with |v| <= 448, as fp32: steps of 2^(exp - 3), the
    subnormal step 2^-9 below 2^-6; rounding by the 1.5 * 2^23 magic constant (exact for |t| < 2^22)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    t = v / step
    return ((t + 12582912.0) - 12582912.0) * step


@triton.jit
def rne_bf16(v):
    """fp32 v rounded to the nearest bf16 (ties to even), still fp32: the interpreter's fp32 -> bf16 cast
    truncates, so it is fed values it can truncate exactly."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def quant_fp8(a, EMULATE_FP8: tl.constexpr):
    """a [M, 128] fp32 (masked columns 0) -> (q [M, 128] e4m3 (fp32 holding e4m3 values when EMULATE_FP8),
    scale [M] fp32): fp8.py's per-group activation quantization."""
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10) / 448.0
    q = tl.minimum(tl.maximum(a / scale[:, None], -448.0), 448.0)
    if EMULATE_FP8:
        q = round_e4m3(q)
    else:
        q = q.to(tl.float8e4nv)
    return q, scale
