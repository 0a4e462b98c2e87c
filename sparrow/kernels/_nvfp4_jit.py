"""Triton body of the NVFP4 linear (launcher and torch twins: ``sparrow.kernels.nvfp4_linear``).

Shapes: R = rows, K = input width (a multiple of 32 here: the launcher pads nothing, it refuses), N = output
width; x [R, K], codes [N, K/2] uint8 (two e2m1 codes a byte, the even column in the low nibble), scales
[N, K/16] e4m3, g [N] fp32 (the global multiplier of each output row), y [R, N].

One program owns a BLOCK_R x BLOCK_N output tile and walks K in 32-wide steps (16 bytes of codes per weight
row, two e4m3 scale groups). Hopper has no FP4 MMA; two compute modes:
- W4A16 (W4A8 False): each e2m1 value times its group's e4m3 scale, which is exact in bf16 / fp16 (a 2-bit
  by 4-bit significand product has at most 6 significant bits), then one x-dtype tl.dot over the 32 columns;
- W4A8: every e2m1 value is exact in e4m3, but value * scale is not (1.5 * 1.125 needs 4 fraction bits), so
  the scales must multiply partial sums, one per 16-column group. x is quantized per row and 16-column group
  in registers (scale = max(amax, 1e-10) / 448, e4m3, as ``kernels.fp8``'s activations but in groups of 16),
  and each 32-wide step runs two e4m3 dots with the other group's columns of x zeroed (K = 32, the e4m3 MMA's
  depth); acc += dot0 * xs0 * s0 + dot1 * xs1 * s1. The doubled MMA work is cheap where the step is bound
  by weight bytes (decode); whether it beats W4A16 is the lead's measurement (switch SPARROW_NVFP4_W4A8).
The global multiplier is applied once to the fp32 accumulator; y is rounded once to x's dtype.
UPCAST / EMULATE_FP8 (interpreter): dots in fp32 on exactly widened operands, e4m3 rounding emulated
(``_fp8_jit``).
"""
import triton
import triton.language as tl

from sparrow.kernels._fp8_jit import dot_upcast, round_e4m3


@triton.jit
def _e2m1(code):
    """uint8 codes (0..15) -> fp32 e2m1 values: magnitude m = code & 7 is (e = m >> 1, f = m & 1):
    e = 0 -> f / 2, else (1 + f / 2) * 2^(e - 1); bit 3 is the sign."""
    m = (code & 7).to(tl.int32)
    e = m >> 1
    f = (m & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * f, (1.0 + 0.5 * f) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def nvfp4_linear_kernel(
    x_ptr,  # [R, K], unit stride on K
    w_ptr,  # [N, K/2] uint8, unit stride
    s_ptr,  # [N, K/16] e4m3, unit stride
    g_ptr,  # [N] fp32
    y_ptr,  # [R, N] contiguous, x's dtype
    R,
    N,
    K,
    stride_xr,
    stride_wn,
    stride_sn,
    W4A8: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 dots (fp32 x, or the interpreter)
    EMULATE_FP8: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, 16)  # bytes of a 32-column step
    rk = tl.arange(0, 32)
    r_mask = rr < R
    n_mask = rn < N
    first = rk < 16  # the step's first scale group
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 32):
        b = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // 2 + rb)[None, :], mask=n_mask[:, None], other=0)
        v = tl.interleave(_e2m1(b & 15), _e2m1(b >> 4))  # [BLOCK_N, 32] in column order
        s0 = tl.load(s_ptr + rn * stride_sn + k0 // 16, mask=n_mask, other=0.0).to(tl.float32)
        s1 = tl.load(s_ptr + rn * stride_sn + k0 // 16 + 1, mask=n_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rr[:, None] * stride_xr + (k0 + rk)[None, :], mask=r_mask[:, None], other=0.0)
        if W4A8:
            xf = x.to(tl.float32)
            xs0 = tl.maximum(tl.max(tl.abs(tl.where(first[None, :], xf, 0.0)), axis=1), 1e-10) / 448.0
            xs1 = tl.maximum(tl.max(tl.abs(tl.where(first[None, :], 0.0, xf)), axis=1), 1e-10) / 448.0
            q = xf / tl.where(first[None, :], xs0[:, None], xs1[:, None])
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
            if EMULATE_FP8:
                q = round_e4m3(q)
                vt = tl.trans(v)
            else:
                q = q.to(tl.float8e4nv)
                vt = tl.trans(v.to(tl.float8e4nv))
            zero = tl.zeros_like(q)
            p0 = dot_upcast(tl.where(first[None, :], q, zero), vt, EMULATE_FP8)
            p1 = dot_upcast(tl.where(first[None, :], zero, q), vt, EMULATE_FP8)
            acc += p0 * (xs0[:, None] * s0[None, :]) + p1 * (xs1[:, None] * s1[None, :])
        else:
            w = v * tl.where(first[None, :], s0[:, None], s1[:, None])  # exact in x's dtype (module doc)
            acc += dot_upcast(x, tl.trans(w.to(x.dtype)), UPCAST)
    g = tl.load(g_ptr + rn, mask=n_mask, other=0.0)
    y = acc * g[None, :]
    tl.store(y_ptr + rr[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=r_mask[:, None] & n_mask[None, :])
