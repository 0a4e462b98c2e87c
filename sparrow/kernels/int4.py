"""int4 W4A16 weights: the layout the kernels read, and its torch references (pack, unpack, quantize,
dequantize, matmul). Checkpoint layouts (compressed-tensors, GPTQ, AWQ) are converted to it at load
(``sparrow.quant.int4``).

Shapes: N = out features, K = in features (a multiple of 8), G = ceil(K / group) scale groups per row,
E = experts (optional leading dims).

Layout (compressed-tensors ``pack-quantized`` 4-bit, ``compressed_tensors.compressors.pack_quantized``):
- ``packed`` int32 [..., N, K / 8]: bits 4j..4j+3 of word [n, w] hold the unsigned code u[n, 8w + j] in 0..15
  (element k at word k // 8, nibble k % 8, low nibble first);
- ``scale`` [..., N, G] fp32 / bf16 / fp16: one per ``group`` consecutive k of a row (the last group may be
  shorter when K is not a multiple of ``group``: on-load quantization only, checkpoints have full groups);
- ``zero`` uint8 [..., N, G] in 0..16, or None for symmetric weights (zero 8).
w[n, k] = (u[n, k] - zero[n, k // group]) * scale[n, k // group], the product rounded to the scale dtype
(what compressed-tensors' ``decompress`` computes: it subtracts and multiplies in the scale dtype, and a
product of an integer in -16..15 and a bf16 / fp16 scale is exact in fp32 before that rounding).

Quantization (``quantize_int4_ref``): round to nearest (ties to even) with compressed-tensors' min-max
formula per group: symmetric scale = amax / 7.5 (q = clamp(round(w / scale), -8, 7), u = q + 8); asymmetric
scale = (max(w, 0) - min(w, 0)) / 15, zero point zp = clamp(round(-8 - min / scale), -8, 7),
q = clamp(round(w / scale + zp), -8, 7), stored as u = q + 8, zero = zp + 8. A zero scale becomes the scale
dtype's eps. Computed in fp32, so it equals compressed-tensors bit for bit on fp32 weights.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from sparrow.kernels import ForcedConfig, interpreting, use_triton

PACK = 8
"""Codes per int32 word."""
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = 128
SYMMETRIC_ZERO = 8
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4_ref(u: torch.Tensor) -> torch.Tensor:
    """u [..., K] integer codes in 0..15 -> int32 [..., K / 8] (the layout above). Raises ValueError when K
    is not a multiple of 8 or a code is out of range."""
    if u.shape[-1] % PACK:
        raise ValueError(f"pack_int4: the last dim ({u.shape[-1]}) must be a multiple of {PACK}")
    if u.is_floating_point() or (u.numel() and (int(u.min()) < 0 or int(u.max()) > 15)):
        raise ValueError("pack_int4: codes must be integers in 0..15")
    v = u.to(torch.int64).reshape(*u.shape[:-1], -1, PACK) << _SHIFTS.to(u.device, torch.int64)
    word = v.sum(-1)  # < 2^32: fold into int32's range (two's complement)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4_ref(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K / 8] -> uint8 codes [..., K] in 0..15 (inverse of ``pack_int4_ref``)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4: packed must be int32, got {packed.dtype}")
    u = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return u.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def num_groups(k: int, group: int) -> int:
    return -(-k // group)


def _expand(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[..., G] -> [..., K]: each group's value repeated over its columns."""
    return t.repeat_interleave(group, dim=-1)[..., :k]


def dequantize_int4_ref(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        group: int) -> torch.Tensor:
    """(packed [..., N, K / 8], scale [..., N, G], zero [..., N, G] | None) -> w [..., N, K] in scale's dtype.
    Raises ValueError on mismatched shapes."""
    u = unpack_int4_ref(packed)
    k = u.shape[-1]
    g = num_groups(k, group)
    if tuple(scale.shape) != tuple(u.shape[:-1]) + (g,) or (zero is not None and zero.shape != scale.shape):
        raise ValueError(f"dequantize_int4: packed {tuple(packed.shape)} (K = {k}, group {group}) needs scale / "
                         f"zero {tuple(u.shape[:-1]) + (g,)}, got {tuple(scale.shape)} / "
                         f"{None if zero is None else tuple(zero.shape)}")
    z = SYMMETRIC_ZERO if zero is None else _expand(zero.float(), group, k)
    return ((u.float() - z) * _expand(scale.float(), group, k)).to(scale.dtype)


def quantize_int4_ref(w: torch.Tensor, group: int = DEFAULT_GROUP, symmetric: bool = True,
                      scale_dtype: torch.dtype | None = None):
    """w [..., N, K] float -> (packed int32 [..., N, K / 8], scale [..., N, G] in ``scale_dtype`` (default
    w's dtype), zero uint8 [..., N, G] or None when ``symmetric``); formula in the module doc. Raises
    ValueError for a non-float w or K not a multiple of 8."""
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"quantize_int4: w must be a float tensor [..., N, K], got {tuple(w.shape)} {w.dtype}")
    k = w.shape[-1]
    if k % PACK:
        raise ValueError(f"quantize_int4: K = {k} must be a multiple of {PACK}")
    scale_dtype = scale_dtype or w.dtype
    g = num_groups(k, group)
    wf = w.float()
    padded = F.pad(wf, (0, g * group - k)).unflatten(-1, (g, group))  # zeros do not move min / max past 0
    lo = padded.amin(-1).clamp_max(0)
    hi = padded.amax(-1).clamp_min(0)
    eps = torch.finfo(scale_dtype).eps
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / 7.5
    else:
        scale = (hi - lo) / 15
    scale = scale.to(scale_dtype)
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale_dtype, device=w.device), scale)
    s = _expand(scale.float(), group, k)
    if symmetric:
        q = torch.round(torch.clamp(wf / s, -8, 7))
        zero = None
    else:
        zp = torch.round(torch.clamp(-8 - lo / scale.float(), -8, 7))
        q = torch.round(torch.clamp(wf / s + _expand(zp, group, k), -8, 7))
        zero = (zp + 8).to(torch.uint8)
    return pack_int4_ref((q + 8).to(torch.uint8)), scale, zero


def int4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """The torch twin of the W4A16 kernels: x [R, K] @ dequantize(packed, scale, zero).T -> [R, N] in x's
    dtype: the weight rounded to the scale dtype, then to x's dtype; products summed in fp32 (on CUDA: F.linear
    in x's dtype, whose GEMMs accumulate in fp32)."""
    _check(x, packed, scale, zero, group, "int4_linear")
    w = dequantize_int4_ref(packed, scale, zero, group).to(x.dtype)
    if x.is_cuda and x.dtype != torch.float32:
        return F.linear(x, w)
    return F.linear(x.float(), w.float()).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class Int4Config:
    """A tile config of ``int4_matmul_kernel``: rows, output columns and K elements per program / step."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


GEMV_MAX_ROWS = 16
"""Rows up to which one M tile covers the batch (decode, verify): each weight element is read once."""
# (largest R, config): first entry whose bound covers R. Untuned defaults (tile configs as data, style.md 9):
# a GEMV-shaped tile at <= 16 rows (rows padded to 16 for tl.dot), a GEMM tile above.
INT4_CONFIGS: tuple[tuple[int, Int4Config], ...] = (
    (GEMV_MAX_ROWS, Int4Config(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3)),
    (1 << 62, Int4Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)),
)
forced_config = ForcedConfig()  # ``with forced_config(Int4Config(...)):`` overrides the table


def w_round(scale_dtype: torch.dtype, x_dtype: torch.dtype) -> int:
    """The kernels' W_ROUND code: the roundings the twin applies to a dequantized fp32 weight (to the scale
    dtype, then to x's dtype)."""
    if scale_dtype == torch.float16:
        return 3 if x_dtype == torch.bfloat16 else 2
    if scale_dtype == torch.bfloat16:  # a bf16 value is exact in fp16 / fp32
        return 1
    return {torch.bfloat16: 1, torch.float16: 2}.get(x_dtype, 0)


def int4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       group: int) -> torch.Tensor:
    """Triton launcher of ``int4_linear_ref`` (same contract), any R."""
    from sparrow.kernels._int4_jit import int4_matmul_kernel

    _check(x, packed, scale, zero, group, "int4_linear")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    n = packed.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    cfg = forced_config.value or next(c for bound, c in INT4_CONFIGS if rows <= bound)
    interp = interpreting()
    grid = (triton_cdiv(n, cfg.block_n), triton_cdiv(rows, cfg.block_m))
    int4_matmul_kernel[grid](
        x, packed, scale, zero if zero is not None else scale, y, rows, n, k, x.stride(0), packed.stride(0),
        scale.stride(0), zero.stride(0) if zero is not None else 0, y.stride(0), group,
        HAS_ZERO=zero is not None, W_ROUND=w_round(scale.dtype, x.dtype), RNE=interp,
        RNE_OUT=interp and x.dtype == torch.bfloat16, UPCAST=interp or x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                group: int) -> torch.Tensor:
    """y = x [R, K] @ dequantize(packed, scale, zero).T -> [R, N] in x's dtype: ``int4_linear_triton`` where
    ``use_triton(x)``, else the twin ``int4_linear_ref``."""
    fn = int4_linear_triton if use_triton(x) else int4_linear_ref
    return fn(x, packed, scale, zero, group)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(x, packed, scale, zero, group, name) -> None:
    if x.dim() != 2 or packed.dim() != 2 or packed.dtype != torch.int32 or x.shape[1] != packed.shape[1] * PACK:
        raise ValueError(f"{name}: need x [R, K] and packed int32 [N, K / 8], got x {tuple(x.shape)}, packed "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if x.dtype not in SCALE_DTYPES or scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}: x and scale must be fp32 / bf16 / fp16, got {x.dtype} and {scale.dtype}")
    want = (packed.shape[0], num_groups(x.shape[1], group))
    if tuple(scale.shape) != want or (zero is not None and (tuple(zero.shape) != want or zero.dtype != torch.uint8)):
        raise ValueError(f"{name}: scale (and uint8 zero) must be {want}, got {tuple(scale.shape)}"
                         f"{'' if zero is None else f' / {tuple(zero.shape)} {zero.dtype}'}")
    for t in (packed, scale) + ((zero,) if zero is not None else ()):
        if t.stride(-1) != 1 or t.device != x.device:
            raise ValueError(f"{name}: weights need unit stride on their last dim and x's device")
