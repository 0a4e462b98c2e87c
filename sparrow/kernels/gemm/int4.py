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
import functools
import json
import math
import pathlib

import torch
import torch.nn.functional as F

from sparrow.kernels import ForcedConfig, dispatch, interpreting
from sparrow.kernels.common.tiles import CONFIG_DIR, FMA_ROWS, cdiv

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


QUANTIZE_CHUNK = 1 << 24
"""Elements of w that ``quantize_int4_ref`` quantizes at a time on a GPU: the formula is row-wise, so rows taken in
chunks give the same result while its fp32 temporaries stay near 10 x 64 MB whatever w's size (a stacked MoE
weight of gemma4-26b-a4b is 5 x 10^8 elements)."""

QUANTIZE_CHUNK_CPU = 1 << 18
"""The same on the CPU, where launches cost nothing and host memory is what a load is bounded by (temporaries
near 10 x 1 MB: loading in bounded memory, tests/loader/test_load_memory.py)."""


def quantize_int4_ref(w: torch.Tensor, group: int = DEFAULT_GROUP, symmetric: bool = True,
                      scale_dtype: torch.dtype | None = None):
    """w [..., N, K] float -> (packed int32 [..., N, K / 8], scale [..., N, G] in ``scale_dtype`` (default
    w's dtype), zero uint8 [..., N, G] or None when ``symmetric``); formula in the module doc, rows taken
    ``QUANTIZE_CHUNK`` (CPU: ``QUANTIZE_CHUNK_CPU``) elements at a time. Raises ValueError for a non-float w or K not a multiple of 8."""
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"quantize_int4: w must be a float tensor [..., N, K], got {tuple(w.shape)} {w.dtype}")
    k = w.shape[-1]
    if k % PACK:
        raise ValueError(f"quantize_int4: K = {k} must be a multiple of {PACK}")
    scale_dtype = scale_dtype or w.dtype
    chunk = QUANTIZE_CHUNK if w.is_cuda else QUANTIZE_CHUNK_CPU
    if w.numel() <= chunk:
        return _quantize_rows(w, group, symmetric, scale_dtype)
    rows = w.reshape(-1, k)
    step = max(1, chunk // k)
    parts = [_quantize_rows(rows[i:i + step], group, symmetric, scale_dtype) for i in range(0, rows.shape[0], step)]
    lead = tuple(w.shape[:-1])
    return tuple(None if part[0] is None else torch.cat(part).reshape(*lead, -1) for part in zip(*parts))


def _quantize_rows(w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype):
    """``quantize_int4_ref`` of w [..., N, K] in one pass (every step works along the last dim)."""
    k = w.shape[-1]
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
    """A tile config of ``w4_matmul_kernel`` (int4 and NVFP4 W4A16 linears)."""
    block_m: int
    """Rows per program (power of two, >= 16; with ``fma`` any power of two); at most GEMV_MAX_ROWS rows take one
    M tile (weights read once)."""
    block_n: int
    """Output columns per program (power of two, >= 16)."""
    block_k: int
    """K elements per loop step (power of two, >= 16); split into dots of SUB_K = min(block_k, group) for int4
    (each inside one scale group) and min(block_k, 128) for NVFP4."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    """Programs per output tile over contiguous K ranges, reduced in the kernel (``split_k``); 0: enough for
    ``split_k.FILL_PROGRAMS`` programs. Only with one M tile (R <= block_m)."""
    scale_w: bool = False
    """int4: group scales multiply the weight tile before the dot (one accumulating dot per step: GEMM tiles)
    instead of the dot's result (fewer operations per weight element: GEMV tiles)."""
    swap_ab: bool = False
    """Dots as W tile [block_n, K step] @ rows^T: the weight fills the MMA's M side (Hopper wgmma from
    block_n = 64) and the few rows its N side."""
    fma: bool = False
    """No dots: the decoded weight tile meets the rows of x in fp32 FMAs (``_w4_fma_jit._w4_fma_rows``), summed per
    step: no MMA padding of the rows to 16 and no layout conversion of the weight tile for the dot, one FMA per
    element per row (GEMV tiles of one or a few rows; int4 steps of at most one group: block_k is cut to it)."""


GEMV_MAX_ROWS = 16
"""Rows up to which one M tile covers the batch (decode, verify): each weight word is read once."""
# (largest R, config): the first entry whose bound covers R (tile configs as data), after the entries of
# the device's tuned file for the format (``config_file``, ``pick_config``). The GEMV entry:
# the H200 sweep of benchmarks/kernels_micro.py tune_int4 (19 tiles at R = 1 and 8, gemma4-26b-a4b's
# (N, K) = (4096, 2816), (2816, 4096), (8192, 2816)): swapped 64 x 128 tiles with split-K 4 were the fastest
# or within 7 % of it on every shape, while
# automatic split-K was not among any shape's four best. 17-64 rows: swapped 64 x 64 x 128 (from the sm_90
# SASS: wgmma, ~5.4 instructions per weight element for int4, ~8.6 NVFP4). Above 64 rows a 128 x 128 x 64 tile
# on wgmma with the scales on the weights (no spills at 8 warps).
INT4_CONFIGS: tuple[tuple[int, Int4Config], ...] = (
    (GEMV_MAX_ROWS, Int4Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=4,
                               swap_ab=True)),
    (64, Int4Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=0, swap_ab=True)),
    (1 << 62, Int4Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, scale_w=True)),
)
forced_config = ForcedConfig()  # ``with forced_config(Int4Config(...)):`` overrides the table


def FP32_CONFIG(rows: int) -> Int4Config:  # noqa: N802  (a table entry computed from R)
    """fp32 activations on CUDA (dots on fp32 operands: twice the registers per tile; the bf16 tiles spill):
    swapped 64 x 64 tiles, 16 or 64 rows each, two stages (no spills in the sm_90 SASS)."""
    return Int4Config(block_m=16 if rows <= GEMV_MAX_ROWS else 64, block_n=64, block_k=64, num_warps=4,
                      num_stages=2, split_k=0 if rows <= 64 else 1, swap_ab=True)


def config_file(kind: str, device_name: str) -> pathlib.Path:
    """The tuned dense-tile data file of a 4-bit format (``kind`` "int4" / "nvfp4") on a device (its
    ``torch.cuda.get_device_name()``, spaces as underscores), written by ``benchmarks/kernels_micro.py
    tune_w4_fma``: {"configs": {"R": Int4Config fields}}, each entry covering the rows up to R (smallest first)."""
    return CONFIG_DIR / f"w4_linear_{kind}_{device_name.replace(' ', '_')}.json"


@functools.lru_cache(maxsize=16)
def tuned_configs(kind: str, device_name: str) -> tuple[tuple[int, Int4Config], ...]:
    """(largest R, config) entries of ``config_file``, smallest bound first; () when there is none."""
    path = config_file(kind, device_name)
    if not path.is_file():
        return ()
    data = json.loads(path.read_text())["configs"]
    return tuple(sorted((int(r), Int4Config(**c)) for r, c in data.items()))


def pick_config(rows: int, kind: str = "int4", device_name: str | None = None) -> Int4Config:
    """The forced config, else the first entry covering ``rows`` of the device's tuned file for the format
    (``tuned_configs``; rows past its last bound fall through), else of INT4_CONFIGS."""
    if forced_config.value is not None:
        return forced_config.value
    table = tuned_configs(kind, device_name) if device_name else ()
    return next(c for bound, c in table + INT4_CONFIGS if rows <= bound)


def int4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       group: int) -> torch.Tensor:
    """Triton launcher of ``int4_linear_ref`` (same contract), any R: the W4A16 kernel ``w4_matmul_kernel``
    (fp32 sums of x * (u - zero), times the group scale)."""
    _check(x, packed, scale, zero, group, "int4_linear")
    return w4_linear_launch(x, packed, scale, zero, None, group)


DEQUANT_MIN_ROWS = 128
"""Rows from which a 4-bit linear dequantizes its weight to x's dtype (``w4_dequantize``) and runs F.linear
(cuBLAS) instead of ``w4_matmul_kernel``. Read at each call. H200, ``benchmarks/kernels_micro.py w4_prefill``
(Gemma 4 26B-A4B's three dense shapes, bf16): the dequantize path is faster from 128 rows on every shape (the
figures: benchmarks/README.md, 4-bit weights); below 128 rows the kernels read 4x fewer bytes."""


def w4_dequantize(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, g: torch.Tensor | None,
                  group: int, dtype: torch.dtype, g_rows: int = 1, divide_global: bool = False) -> torch.Tensor:
    """4-bit weights as int32 words [..., N, K / 8] (one weight [N, ...] or stacked experts [E, N, ...]) -> float
    [..., N, K] in ``dtype``, on Triton (``_int4_jit.w4_dequant_kernel``), equal to the twins:
    int4 (``g`` None; scale [..., N, G], zero uint8 [..., N, G] | None): ``dequantize_int4_ref(...).to(dtype)``;
    NVFP4 (scale e4m3 [..., N, K / 16], group 16; ``g`` fp32, one global multiplier per ``g_rows`` consecutive rows
    of the flattened [E * N] rows, e.g. [E, 2] for gate|up halves of I rows with g_rows = I, or None):
    ``dequantize_nvfp4_ref(...).to(dtype)`` (w = e2m1 * (scale * g), or / g with ``divide_global``).
    Operands contiguous, checked by the caller."""
    from sparrow.kernels.gemm._int4_jit import w4_dequant_kernel

    nvfp4 = scale.dtype == torch.float8_e4m3fn
    k = words.shape[-1] * PACK
    rows = words.numel() // words.shape[-1]
    out = torch.empty(*words.shape[:-1], k, dtype=dtype, device=words.device)
    if rows == 0 or k == 0:
        return out
    block_k = 128 if nvfp4 else math.gcd(group, 128)  # int4: each tile inside one group
    if nvfp4 and k % 16 or not nvfp4 and block_k < 8:
        raise ValueError(f"w4_dequantize: K = {k} with group {group} does not fit (NVFP4: K % 16 == 0; int4: a "
                         "group that is a multiple of 8)")
    interp = interpreting()
    block_r = 32
    w4_dequant_kernel[(cdiv(rows, block_r), cdiv(k, block_k))](
        words, scale, zero if zero is not None else scale, g if g is not None else scale, out, rows, k,
        words.shape[-1], scale.shape[-1], k, g_rows, group, NVFP4=nvfp4, HAS_ZERO=zero is not None,
        HAS_G=g is not None, DIVIDE_G=divide_global, RNE_S=interp and scale.dtype == torch.bfloat16,
        RNE_OUT=interp and dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out


def w4_linear_launch(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     g: torch.Tensor | None, group: int) -> torch.Tensor:
    """y [R, N] = x [R, K] @ W^T for 4-bit weights as int32 words [N, K / 8]: int4 (``g`` None: scale [N, G],
    zero [N, G] uint8 | None) or NVFP4 W4A16 (``g`` fp32 [N]: scale e4m3 [N, K / 16], group 16). From
    ``DEQUANT_MIN_ROWS`` rows (no forced config): ``w4_dequantize`` then F.linear (NVFP4: the global multiplier
    folded into the weight, rounded to x's dtype once); else ``w4_matmul_kernel``. Operands checked by the caller.
    Raises ValueError for a forced config the kernel cannot run."""
    from sparrow.kernels.gemm._int4_jit import w4_matmul_kernel
    from sparrow.kernels import pdl_kwargs
    from sparrow.kernels.common import split_k

    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    n = words.shape[0]
    nvfp4 = g is not None
    if rows >= DEQUANT_MIN_ROWS and forced_config.value is None and n:
        return F.linear(x, w4_dequantize(words, scale, zero, g, group, x.dtype))
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    cfg = pick_config(rows, "nvfp4" if nvfp4 else "int4", torch.cuda.get_device_name(x.device) if x.is_cuda else None)
    if x.dtype == torch.float32 and x.is_cuda and forced_config.value is None and not cfg.fma:
        cfg = FP32_CONFIG(rows)
    if cfg.fma and not nvfp4 and cfg.block_k > group:  # an FMA step scales one group's sums: a step per group
        cfg = dataclasses.replace(cfg, block_k=group)
    sub_k = min(cfg.block_k, 128 if nvfp4 else group)
    if cfg.block_k % sub_k or sub_k < 16 or cfg.block_n < 16 or (
            cfg.block_m not in FMA_ROWS if cfg.fma else cfg.block_m < 16):
        raise ValueError(f"int4_linear: {cfg} does not fit group {group} (block_k a multiple of the group or "
                         f"dividing it, tiles >= 16; FMA tiles: block_m in {FMA_ROWS})")
    interp = interpreting()
    m_tiles, n_tiles = cdiv(rows, cfg.block_m), cdiv(n, cfg.block_n)
    split, ws, locks = split_k.plan(x.device, n_tiles, cdiv(k, cfg.block_k), cfg.split_k if m_tiles == 1 else 1,
                                    cfg.block_m * cfg.block_n, y)
    w4_matmul_kernel[(n_tiles, m_tiles, split)](
        x, words, scale, zero if zero is not None else scale, g if nvfp4 else scale, y, ws, locks, rows, n, k,
        x.stride(0), words.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0, y.stride(0), group,
        NVFP4=nvfp4, HAS_ZERO=zero is not None, SCALE_W=cfg.scale_w, UPCAST=interp or x.dtype == torch.float32,
        RNE_OUT=interp and x.dtype == torch.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SUB_K=sub_k, SPLIT_K=split, SWAP_AB=cfg.swap_ab, FMA=cfg.fma, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kwargs(x))
    return y


int4_linear = dispatch("int4_linear", int4_linear_triton, int4_linear_ref, """y = x [R, K] @ dequantize(packed,
    scale, zero).T -> [R, N] in x's dtype (``int4_linear_ref``'s signature): ``int4_linear_triton`` where
    ``use_triton(x)``, else the twin ``int4_linear_ref``.""")


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
