"""Triton body of the gated activations (launcher and torch twin: ``sparrow.kernels.activation.act``).

Shapes: R = rows, I = intermediate width; x [R, 2I] holds gate = x[:, :I] and up = x[:, I:].
One program computes BLOCK_I outputs of one row.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._pdl_jit import pdl_enter

SILU = 0
GELU_TANH = 1


@triton.jit
def act_and_mul_kernel(
    x_ptr,  # [R, 2I], unit stride on the last dim
    y_ptr,  # [R, I] contiguous, x's dtype
    I,
    stride_xr,
    ACT: tl.constexpr,  # SILU or GELU_TANH
    BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xr + I + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        # silu(g) = g * sigmoid(g) = g / (1 + exp(-g))
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with
        # 1 + tanh(z) = 2 - 2 / (exp(2z) + 1) = 2 * sigmoid(2z): no tanh intrinsic, exact at both tails.
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    tl.store(y_ptr + row * I + cols, (act * up).to(y_ptr.dtype.element_ty), mask=mask)
