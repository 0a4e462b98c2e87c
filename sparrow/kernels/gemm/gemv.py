"""GEMV for few rows (decode, speculative verify): y = x @ w.T with each weight element read once.

Shapes: R = rows (<= MAX_ROWS = 16; FP8 weights <= FP8_MAX_ROWS = 64), K = input width, N = output width.

    gemv(x [R, K], w [N, K]) -> y [R, N]                         w: bf16 / fp16 / fp32, x's dtype
    gemv_fp8(x [R, K], w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)] fp32) -> y [R, N]
        w = w_e4m3 * w_scale[n // 128, k // 128] (DeepSeek / Qwen FP8 ``weight_scale_inv``, see fp8.py);
        x unquantized (W8A16)
    gemv_w8a8(x [R, K], w, w_scale) -> y [R, N]: the same weights, x quantized per row and 128-column group
        (W8A8, the numbers of ``fp8_gemm_ref``, its twin); R <= W8A8_MAX_ROWS = 16

Accumulation is fp32; y is rounded once to x's dtype. ``*_ref`` are the torch twins (CPU path and
oracle), ``*_triton`` the launchers (same signatures), ``gemv`` / ``gemv_fp8`` the dispatchers: Triton for
CUDA tensors with R <= MAX_ROWS (``gemv_fp8``: FP8_MAX_ROWS; or anywhere under ``sparrow.kernels.backend("triton")``),
otherwise the twin (on CUDA, ``gemv`` with R > MAX_ROWS goes to cuBLAS through ``F.linear``; larger R is a GEMM's job).

Tile configs are data: ``GEMV_CONFIGS`` (``FP8_GEMV_CONFIGS`` for e4m3 weights) maps a row
bound to a ``GemvConfig``; the launcher takes the first entry whose bound covers R; an entry without
split-K narrows BLOCK_N until the grid has ``MIN_PROGRAMS`` programs (all SMs busy), one with automatic
split-K (``split_k=0``) keeps its BLOCK_N and splits K instead. Tests force a config with ``with forced_config(GemvConfig(...)):``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from sparrow.kernels import ForcedConfig, dispatch, interpreting, pdl_kwargs, use_triton
from sparrow.kernels.common import split_k
from sparrow.kernels.common.tiles import next_pow2
from sparrow.kernels.gemm.fp8 import FP8_DTYPE, GROUP, dequantize_fp8_block_ref

MAX_ROWS = 16  # the GEMV path ends here; more rows are a GEMM
FP8_MAX_ROWS = 64
"""Rows up to which FP8 linears take the W8A16 GEMV (quant/fp8.py); more rows take the W8A8 ``fp8_gemm``.
At 32 and 64 rows the GEMV is the faster of the two on every gemma4 shape (kernels_micro.py tune_fp8_rows; the
figures: benchmarks/README.md, FP8 linears)."""


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int
    """Output columns per program (power of two, >= 16)."""
    block_k: int
    """K elements per loop step (power of two, >= 16); FP8 weights split it into dots of
    at most 128 so each stays inside one scale block."""
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    """y^T = w @ x^T, the weight as the dot's first (K-major) operand and the rows padded to
    16 as its second ("swap AB" for small M); block_n >= 16."""
    split_k: int = 1
    """Programs per N tile, each over a contiguous K range, reduced in the kernel (``split_k``); 0: enough
    for ``split_k.FILL_PROGRAMS`` programs. More weight bytes in flight when N has few tiles."""


# (largest R, config). H200 sweep (benchmarks/kernels_micro.py tune_gemv_bf16 / tune_gemv_fp8: block_n 32-64,
# block_k 256-512, split-K 1-8, at R = 1 and 8; K x N = 2816 x 8192,
# 4096 x 2816, 2112 x 2816, 2816 x 4224). One entry wins for both weight formats: tensor-core dots on rows
# padded to 16, 32 x 256 tiles, and split-K where N has few tiles (automatic: FILL_PROGRAMS = 352 programs).
# R = 8 costs about what R = 1 does; the 2816-wide outputs need split-K. Time barely falls with the bytes (a
# fixed cost per call dominates), so FP8 weights save little in these GEMVs; swap_ab lost in the sweep.
GEMV_CONFIGS: tuple[tuple[int, GemvConfig], ...] = (
    (MAX_ROWS, GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, split_k=0)),
)
# Past 16 rows (FP8 only, rows padded to 32 / 64): the best of tune_fp8_rows' sweep (block_n 32-64, block_k
# 128-256, split-K automatic or 1) at most shapes.
FP8_GEMV_CONFIGS: tuple[tuple[int, GemvConfig], ...] = GEMV_CONFIGS + (
    (32, GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=0)),
    (FP8_MAX_ROWS, GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=0)),
)
W8A8_MAX_ROWS = 16
"""Rows up to which FP8 linears take the W8A8 GEMV (``gemv_w8a8``); 17 to FP8_MAX_ROWS take the W8A16 GEMV."""
# W8A8: x quantized per 128-column group in registers, e4m3 tensor-core dots with swapped operands (the weight
# tile is the wgmma's M side, 64 rows; the plain orientation, e4m3 dots with 16 rows as M, lost in the sweep
# and gave wrong sums on the H200, so the launcher refuses it). H200 (kernels_micro.py tune_w8a8): from 1 to 8
# rows W8A8 beats the W8A16 GEMV on every gemma4 shape (benchmarks/README.md, FP8 linears); at 64 rows W8A16
# wins at three of four shapes.
W8A8_GEMV_CONFIGS: tuple[tuple[int, GemvConfig], ...] = (
    (W8A8_MAX_ROWS, GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True,
                               split_k=0)),
)
MIN_PROGRAMS = 132  # one program per SM of an H100 / H200 before BLOCK_N narrows

forced_config = ForcedConfig()  # ``with forced_config(GemvConfig(...)):`` overrides the heuristic
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)



def pick_config(rows: int, n: int, fp8: bool, w8a8: bool = False) -> GemvConfig:
    """The forced config, else the table's entry for ``rows``; without split-K, BLOCK_N narrowed to fill the GPU
    (automatic split-K fills it with K splits instead, at the tile size the sweep measured)."""
    if forced_config.value is not None:
        return forced_config.value
    table = W8A8_GEMV_CONFIGS if w8a8 else FP8_GEMV_CONFIGS if fp8 else GEMV_CONFIGS
    config = next(c for bound, c in table if rows <= bound)
    block_n = config.block_n
    while config.split_k == 1 and block_n > 16 and -(-n // block_n) < MIN_PROGRAMS:
        block_n //= 2
    return dataclasses.replace(config, block_n=block_n)


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [R, K] @ w [N, K].T in fp32, rounded to x's dtype: [R, N]. Raises ValueError on bad inputs."""
    _check(x, w, "gemv", max_rows=None)
    return F.linear(x.float(), w.float()).to(x.dtype)


def gemv_fp8_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [R, K] @ dequant(w e4m3 [N, K], w_scale [ceil(N/128), ceil(K/128)]).T in fp32 -> [R, N] x's dtype."""
    _check(x, w, "gemv_fp8", max_rows=None, w_scale=w_scale)
    return F.linear(x.float(), dequantize_fp8_block_ref(w, w_scale, GROUP)).to(x.dtype)


def gemv_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``gemv_ref`` (same contract) for R <= MAX_ROWS."""
    _check(x, w, "gemv", max_rows=MAX_ROWS)
    return _launch(x, w, None)


def gemv_fp8_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``gemv_fp8_ref`` (same contract) for R <= the last FP8_GEMV_CONFIGS bound."""
    _check(x, w, "gemv_fp8", max_rows=FP8_GEMV_CONFIGS[-1][0], w_scale=w_scale)
    return _launch(x, w, w_scale)


def gemv_w8a8_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A8 GEMV for R <= the last W8A8_GEMV_CONFIGS bound: the contract of ``fp8_gemm_ref(x, w, w_scale)``
    (x quantized per row and 128-column group, e4m3 tensor-core dots, fp32 accumulation) with each weight
    element read once. Raises ValueError on bad inputs or a forced config other than swapped dots with
    block_k a multiple of 128."""
    _check(x, w, "gemv_w8a8", max_rows=W8A8_GEMV_CONFIGS[-1][0], w_scale=w_scale)
    return _launch(x, w, w_scale, quant_x=True)


def gemv_w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = quant(x) @ dequant(w, w_scale).T (W8A8): Triton for R <= W8A8_MAX_ROWS where ``use_triton``, else
    the twin ``fp8_gemm_ref``."""
    if x.shape[0] <= W8A8_MAX_ROWS and use_triton(x):
        return gemv_w8a8_triton(x, w, w_scale)
    from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_ref

    _check(x, w, "gemv_w8a8", max_rows=None, w_scale=w_scale)
    return fp8_gemm_ref(x, w, w_scale)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T for x [R, K], w [N, K] of x's dtype -> [R, N]; see the module doc for the dispatch."""
    if x.shape[0] <= MAX_ROWS and use_triton(x):
        return gemv_triton(x, w)
    if x.is_cuda:
        _check(x, w, "gemv", max_rows=None)
        return F.linear(x, w)
    return gemv_ref(x, w)


def _fp8_rows_fit(x: torch.Tensor, *args, **kwargs) -> bool:
    return x.shape[0] <= FP8_MAX_ROWS


gemv_fp8 = dispatch("gemv_fp8", gemv_fp8_triton, gemv_fp8_ref, """y = x @ dequant(w, w_scale).T for e4m3 block-scaled
    w; see the module doc for the dispatch.""", fits=_fp8_rows_fit)


def _launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, quant_x: bool = False) -> torch.Tensor:
    from sparrow.kernels.gemm._gemv_jit import gemv_kernel

    rows, k = x.shape
    n = w.shape[0]
    fp8 = w_scale is not None
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    cfg = pick_config(rows, n, fp8, quant_x)
    sub_k = min(cfg.block_k, GROUP) if fp8 else cfg.block_k
    if fp8 and (GROUP % sub_k != 0 or cfg.block_k % sub_k != 0):
        raise ValueError(f"gemv_fp8: block_k {cfg.block_k} must divide or be a multiple of the 128 scale block")
    if quant_x and (sub_k != GROUP or not cfg.swap_ab):
        raise ValueError(f"gemv_w8a8: needs swap_ab and block_k a multiple of {GROUP}, got {cfg}")
    block_r = max(16, next_pow2(rows))
    tiles = -(-n // cfg.block_n)
    split, ws, locks = split_k.plan(x.device, tiles, -(-k // cfg.block_k), cfg.split_k, block_r * cfg.block_n, y)
    gemv_kernel[(tiles, split)](
        x,
        w,
        w_scale if fp8 else x,
        y,
        ws,
        locks,
        rows,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w_scale.stride(0) if fp8 else 0,
        FP8_W=fp8,
        SWAP_AB=cfg.swap_ab,
        IEEE=x.dtype == torch.float32,
        BLOCK_R=block_r,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SUB_K=sub_k,
        SPLIT_K=split,
        QUANT_X=quant_x,
        EMULATE_FP8=quant_x and interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kwargs(x),
    )
    return y


def _check(x, w, name, max_rows, w_scale=None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: need x [R, K] and w [N, K], got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if max_rows is not None and x.shape[0] > max_rows:
        raise ValueError(f"{name}: {x.shape[0]} rows > {max_rows}; use a GEMM for larger batches")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: x dtype {x.dtype} not supported (fp32, bf16, fp16)")
    if w_scale is None and w.dtype != x.dtype:
        raise ValueError(f"{name}: w dtype {w.dtype} != x dtype {x.dtype}")
    if w_scale is not None:
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: w must be float8_e4m3fn, got {w.dtype}")
        want = (-(-w.shape[0] // GROUP), -(-w.shape[1] // GROUP))
        if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32 or w_scale.stride(1) != 1:
            raise ValueError(
                f"{name}: w_scale must be fp32 {want} with unit last stride, got {tuple(w_scale.shape)} {w_scale.dtype}"
            )
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{name}: x and w need unit stride on K, got {x.stride()} and {w.stride()}")
    if w.device != x.device or (w_scale is not None and w_scale.device != x.device):
        raise ValueError(f"{name}: x, w (and w_scale) must be on one device")
