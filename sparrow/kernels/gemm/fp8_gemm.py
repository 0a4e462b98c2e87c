"""Block-scaled FP8 GEMM (W8A8) for more rows than the GEMV takes: y = x @ dequant(w).T with x quantized
per row and 128-column group.

Shapes: M = rows, K = input width, N = output width, G = ceil(K / 128).

    fp8_gemm(x [M, K], w [N, K] e4m3, w_scale [ceil(N/128), G] fp32, out_dtype=None) -> [M, N]

x is a float tensor (bf16 / fp16 / fp32), quantized in the kernel per row and 128-column group by the
formula of ``sparrow.kernels.gemm.fp8.quantize_fp8_per_group_ref``. w = w_e4m3 * w_scale[n // 128, k // 128] (DeepSeek / Qwen FP8
``weight_scale_inv``). Accumulation is fp32; y is rounded once to ``out_dtype`` (default: x's dtype). ``fp8_gemm_ref`` is the torch twin (CPU path and oracle: dequantize both operands, fp32
matmul), ``fp8_gemm_triton`` the launcher with the same signature, ``fp8_gemm`` the dispatcher (Triton for
CUDA tensors or under ``sparrow.kernels.backend("triton")``, else the twin).

Tile configs are data: ``FP8_GEMM_CONFIGS`` maps a row bound to a config, the first bound
covering M wins; tests force one with ``with forced_config(Fp8GemmConfig(...)):``. The entries are a
split-K tiles tuned on the H200 up to 64 rows, and untuned defaults above (128 x 128 for prefill).
"""
from __future__ import annotations

import dataclasses

import torch

from sparrow.kernels import ForcedConfig, interpreting, pdl_kwargs, use_triton
from sparrow.kernels.common import split_k
from sparrow.kernels.gemm.fp8 import (
    FP8_DTYPE,
    GROUP,
    dequantize_fp8_block_ref,
    dequantize_fp8_per_group_ref,
    quantize_fp8_per_group_ref,
)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    """Rows per program (power of two, >= 16 for tl.dot)."""
    block_n: int
    """Output columns per program (power of two, >= 16)."""
    group_m: int = 8
    """Row tiles that sweep N together (L2 reuse of the weight tiles)."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    """Programs per output tile, each over a contiguous K range, reduced in the kernel (``split_k``); 0:
    enough for ``split_k.FILL_PROGRAMS`` programs. Decode-sized M has few tiles to spread over the SMs."""


BLOCK_K = GROUP  # one 128-wide scale group per K step

# (largest M, config). Up to 64 rows (decode batches above the GEMV's 16): H200 sweep (kernels_micro.py
# tune_fp8_gemm, M = 64, block_m 32-64, block_n 32-128, split-K 1-8, stages 3-4) at K x N = 2816 x 8192,
# 4096 x 2816, 2112 x 2816, 2816 x 4224: 32 x 128 tiles with split-K 4 are near each shape's best and well ahead
# of every tile without split-K, though still far from the bytes bound. Above 64 rows: untuned defaults (128 x 128
# tiles for prefill, Hopper wgmma).
FP8_GEMM_CONFIGS: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (64, Fp8GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=3, split_k=4)),
    (256, Fp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)),
    (1 << 62, Fp8GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)),
)

forced_config = ForcedConfig()  # ``with forced_config(Fp8GemmConfig(...)):`` overrides the heuristic



def pick_config(rows: int) -> Fp8GemmConfig:
    """The forced config, else the first table entry whose row bound covers ``rows``."""
    if forced_config.value is not None:
        return forced_config.value
    return next(c for bound, c in FP8_GEMM_CONFIGS if rows <= bound)


def fp8_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch twin: quantize x per 128-group, dequantize x and w, fp32 matmul, round to ``out_dtype``.
    Raises ValueError on bad shapes / dtypes (see ``fp8_gemm``)."""
    out_dtype = _check(x, w, w_scale, out_dtype)
    xd = dequantize_fp8_per_group_ref(*quantize_fp8_per_group_ref(x, GROUP), GROUP)
    return (xd @ dequantize_fp8_block_ref(w, w_scale, GROUP).T).to(out_dtype)


def fp8_gemm_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton launcher of ``fp8_gemm_ref`` (same contract)."""
    from sparrow.kernels.gemm._fp8_gemm_jit import fp8_gemm_kernel

    out_dtype = _check(x, w, w_scale, out_dtype)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    cfg = pick_config(m)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split, ws, locks = split_k.plan(x.device, tiles, -(-k // BLOCK_K), cfg.split_k, cfg.block_m * cfg.block_n, y)
    fp8_gemm_kernel[(tiles, split)](
        x,
        w,
        w_scale,
        y,
        ws,
        locks,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w_scale.stride(0),
        INTERPRET=interpreting(),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK_K,
        GROUP_M=cfg.group_m,
        SPLIT_K=split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kwargs(x),
    )
    return y


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ dequant(w, w_scale).T, W8A8; see the module doc for the contract and the dispatch."""
    if use_triton(x):
        return fp8_gemm_triton(x, w, w_scale, out_dtype)
    return fp8_gemm_ref(x, w, w_scale, out_dtype)


def _check(x, w, w_scale, out_dtype) -> torch.dtype:
    """Validate the operands; return the output dtype. Raises ValueError naming the bad operand."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemm: need x [M, K] and w [N, K], got x {tuple(x.shape)}, w {tuple(w.shape)}")
    groups = -(-x.shape[1] // GROUP)
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_gemm: w must be float8_e4m3fn, got {w.dtype}")
    want = (-(-w.shape[0] // GROUP), groups)
    if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32 or w_scale.stride(-1) != 1:
        raise ValueError(f"fp8_gemm: w_scale must be fp32 {want} with unit last stride, "
                         f"got {tuple(w_scale.shape)} {w_scale.dtype}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fp8_gemm: x dtype {x.dtype} not supported (fp32, bf16, fp16)")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"fp8_gemm: x and w need unit stride on K, got {x.stride()} and {w.stride()}")
    devices = {t.device for t in (x, w, w_scale)}
    if len(devices) != 1:
        raise ValueError(f"fp8_gemm: operands on several devices {sorted(map(str, devices))}")
    if out_dtype is None:
        out_dtype = x.dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fp8_gemm: out_dtype {out_dtype} not supported (fp32, bf16, fp16)")
    return out_dtype
