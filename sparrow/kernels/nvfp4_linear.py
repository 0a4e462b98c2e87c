"""NVFP4 linear y = x @ dequant(W).T on Hopper (no FP4 MMA): W4A16 or W4A8 (``_nvfp4_jit`` says how).

Shapes: R = rows, K = in features (a multiple of 32 for the kernel), N = out features.

    nvfp4_linear(x [R, K], codes [N, K/2] uint8, scale [N, K/16] e4m3, g [N] fp32, w4a8=False) -> y [R, N]

w = e2m1(codes) * scale * g (``g`` the per-row global multiplier: ModelOpt's weight_scale_2, the inverse of
compressed-tensors' weight_global_scale). Twins (CPU path and oracle, fp32 arithmetic):
- ``nvfp4_linear_w4a16_ref``: x @ (e2m1 * scale).T * g;
- ``nvfp4_linear_w4a8_ref``: x quantized per row and 16-column group to e4m3 (scale max(amax, 1e-10) / 448),
  dequantized, then the same product.
``nvfp4_linear`` runs the Triton kernel on CUDA tensors (or anywhere under ``backend("triton")``), else the twin.
W4A16 runs ``_int4_jit.w4_matmul_kernel`` (the int4 linears' kernel: one int32 word load per 8 codes, split-K
GEMV at <= 16 rows; its tiles: ``int4.INT4_CONFIGS``), W4A8 ``_nvfp4_jit.nvfp4_linear_kernel``, whose tile
configs are data: ``NVFP4_CONFIGS`` maps a row bound to (BLOCK_R, BLOCK_N, num_warps, num_stages); the first
entry whose bound covers R is used (starting points, not measured on the H200 yet).
"""
from __future__ import annotations

import torch

from sparrow.kernels import interpreting, use_triton
from sparrow.kernels.nvfp4 import GROUP, SCALE_DTYPE, e2m1_values_ref

NVFP4_CONFIGS: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (16, (16, 64, 4, 3)),  # decode / verify: rows padded to 16, 64 weight rows a program
    (64, (64, 64, 4, 3)),
    (1 << 62, (128, 128, 8, 3)),  # prefill tiles
)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weight(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    v = e2m1_values_ref(codes)  # [N, K]
    return (v.unflatten(-1, (-1, GROUP)) * scale.float().unsqueeze(-1)).flatten(-2)


def quantize_x16_ref(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] (K a multiple of 16) rounded through e4m3 per row and 16-column group, as fp32 [R, K]."""
    xg = x.float().unflatten(-1, (-1, GROUP))
    s = xg.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    return ((xg / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).flatten(-2)


def nvfp4_linear_w4a16_ref(x, codes, scale, g) -> torch.Tensor:
    """The W4A16 twin (module doc) -> [R, N] in x's dtype."""
    return ((x.float() @ _weight(codes, scale).T) * g.float()).to(x.dtype)


def nvfp4_linear_w4a8_ref(x, codes, scale, g) -> torch.Tensor:
    """The W4A8 twin (module doc) -> [R, N] in x's dtype."""
    return ((quantize_x16_ref(x) @ _weight(codes, scale).T) * g.float()).to(x.dtype)


def _check(x, codes, scale, g) -> None:
    if x.dim() != 2 or codes.dim() != 2 or codes.shape[1] * 2 != x.shape[1]:
        raise ValueError(f"nvfp4_linear: need x [R, K] and codes [N, K/2], got {tuple(x.shape)}, {tuple(codes.shape)}")
    n, k = codes.shape[0], x.shape[1]
    if codes.dtype != torch.uint8 or scale.dtype != SCALE_DTYPE or tuple(scale.shape) != (n, k // GROUP):
        raise ValueError(f"nvfp4_linear: codes uint8 [N, K/2] and scale e4m3 [N, K/16], got {codes.dtype}, "
                         f"{scale.dtype} {tuple(scale.shape)} for K = {k}")
    if tuple(g.shape) != (n,) or g.dtype != torch.float32:
        raise ValueError(f"nvfp4_linear: g must be fp32 [{n}], got {g.dtype} {tuple(g.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"nvfp4_linear: x dtype {x.dtype} not supported (fp32, bf16, fp16)")


def nvfp4_linear_triton(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, g: torch.Tensor,
                        w4a8: bool = False) -> torch.Tensor:
    """The Triton launcher (module doc). Raises ValueError for K not a multiple of 32 or bad operands."""
    from sparrow.kernels._nvfp4_jit import nvfp4_linear_kernel

    _check(x, codes, scale, g)
    rows, k = x.shape
    n = codes.shape[0]
    if k % 32:
        raise ValueError(f"nvfp4_linear_triton: K = {k} is not a multiple of 32")
    x = x if x.stride(1) == 1 else x.contiguous()
    codes, scale = codes.contiguous(), scale.contiguous()
    if not w4a8:  # the 4-bit kernel of the int4 linears, codes read as int32 words [N, K/8]
        from sparrow.kernels.int4 import w4_linear_launch

        return w4_linear_launch(x, codes.view(torch.int32), scale, None, g.contiguous(), GROUP)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    block_r, block_n, warps, stages = next(c for bound, c in NVFP4_CONFIGS if rows <= bound)
    grid = (-(-n // block_n), -(-rows // block_r))
    nvfp4_linear_kernel[grid](
        x, codes, scale, g, y, rows, n, k, x.stride(0), codes.stride(0), scale.stride(0),
        W4A8=w4a8, UPCAST=x.dtype == torch.float32 or interpreting(), EMULATE_FP8=w4a8 and interpreting(),
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return y


def nvfp4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, g: torch.Tensor,
                 w4a8: bool = False) -> torch.Tensor:
    """y = x @ dequant(W).T: Triton where it runs and K is a multiple of 32, else the twin of the mode."""
    if use_triton(x) and x.shape[1] % 32 == 0:
        return nvfp4_linear_triton(x, codes, scale, g, w4a8)
    _check(x, codes, scale, g)
    return (nvfp4_linear_w4a8_ref if w4a8 else nvfp4_linear_w4a16_ref)(x, codes, scale, g)
