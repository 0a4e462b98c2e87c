"""NVFP4 linear y = x @ dequant(W).T on Hopper (no FP4 MMA), computed W4A16.

Shapes: R = rows, K = in features (a multiple of 16), N = out features.

    nvfp4_linear(x [R, K], codes [N, K/2] uint8, scale [N, K/16] e4m3, g [N] fp32) -> y [R, N] in x's dtype

w = e2m1(codes) * scale * g (``g`` the per-row global multiplier: ModelOpt's weight_scale_2, the inverse of
compressed-tensors' weight_global_scale). Twin (CPU path and oracle, fp32 arithmetic): ``nvfp4_linear_w4a16_ref``,
x @ (e2m1 * scale).T * g. ``nvfp4_linear`` runs the Triton kernel on CUDA tensors (or anywhere under
``backend("triton")``), else the twin.

The kernel is ``_int4_jit.w4_matmul_kernel`` (the int4 linears' kernel: the codes read as int32 words [N, K/8],
one word load per 8 codes, split-K GEMV at <= 16 rows; its tiles: ``int4.INT4_CONFIGS``) at every row count:
each e2m1 value times its block scale is exact in bf16 / fp16, so one x-dtype dot per tile. W4A8 (e4m3 dots)
cannot beat it on Hopper with NVFP4's 16-element groups: e2m1 * e4m3 scale is not exact in e4m3, so the block
scales must multiply partial sums per 16-column group, while the e4m3 MMA's depth is 32 (two dots per 32
columns with half the operand zeroed: the FP8 MMA's 2x rate over bf16 goes to the zero halves), and at decode
both read the same weight bytes.
"""
from __future__ import annotations

import torch

from sparrow.kernels import use_triton
from sparrow.kernels.gemm.nvfp4 import GROUP, SCALE_DTYPE, e2m1_values_ref

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weight(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    v = e2m1_values_ref(codes)  # [N, K]
    return (v.unflatten(-1, (-1, GROUP)) * scale.float().unsqueeze(-1)).flatten(-2)


def nvfp4_linear_w4a16_ref(x, codes, scale, g) -> torch.Tensor:
    """The twin (module doc) -> [R, N] in x's dtype."""
    return ((x.float() @ _weight(codes, scale).T) * g.float()).to(x.dtype)


def _check(x, codes, scale, g) -> None:
    if x.dim() != 2 or codes.dim() != 2 or codes.shape[1] * 2 != x.shape[1]:
        raise ValueError(f"nvfp4_linear: need x [R, K] and codes [N, K/2], got {tuple(x.shape)}, {tuple(codes.shape)}")
    n, k = codes.shape[0], x.shape[1]
    if k % GROUP:
        raise ValueError(f"nvfp4_linear: K = {k} is not a multiple of {GROUP}")
    if codes.dtype != torch.uint8 or scale.dtype != SCALE_DTYPE or tuple(scale.shape) != (n, k // GROUP):
        raise ValueError(f"nvfp4_linear: codes uint8 [N, K/2] and scale e4m3 [N, K/16], got {codes.dtype}, "
                         f"{scale.dtype} {tuple(scale.shape)} for K = {k}")
    if tuple(g.shape) != (n,) or g.dtype != torch.float32:
        raise ValueError(f"nvfp4_linear: g must be fp32 [{n}], got {g.dtype} {tuple(g.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"nvfp4_linear: x dtype {x.dtype} not supported (fp32, bf16, fp16)")


def nvfp4_linear_triton(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The Triton launcher (module doc). Raises ValueError for K not a multiple of 16 or bad operands."""
    from sparrow.kernels.gemm.int4 import w4_linear_launch

    _check(x, codes, scale, g)
    x = x if x.stride(1) == 1 else x.contiguous()
    # uint8 [N, K/2] viewed as int32 words [N, K/8] (K % 16 == 0)
    return w4_linear_launch(x, codes.contiguous().view(torch.int32), scale.contiguous(), None, g.contiguous(), GROUP)


def nvfp4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """y = x @ dequant(W).T: Triton where it runs, else the twin. Raises ValueError for bad operands."""
    if use_triton(x):
        return nvfp4_linear_triton(x, codes, scale, g)
    _check(x, codes, scale, g)
    return nvfp4_linear_w4a16_ref(x, codes, scale, g)
