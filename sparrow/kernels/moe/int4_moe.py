"""int4 W4A16 routed experts: the torch twin and the dispatcher.

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K pairs, G1 = ceil(H / group),
G2 = ceil(I / group).

    int4_fused_moe(x [R, H], w13 int32 [E, 2I, H / 8], w13_scale [E, 2I, G1], w13_zero uint8 [E, 2I, G1] | None,
                   w2 int32 [E, H, I / 8], w2_scale [E, H, G2], w2_zero | None, group, topk_weights [R, K],
                   topk_ids [R, K], activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True)
        -> [R, H] in x's dtype (or the unweighted per-pair outputs [P, H] with reduce=False)

The weights are ``sparrow.kernels.gemm.int4``'s layout. The twin ``int4_fused_moe_ref`` dequantizes the selected
experts to x's dtype (``dequantize_int4_ref``) and runs the float twins of ``moe_ref`` (grouped for
P > pair_threshold, per pair otherwise), so its numbers are the float experts' on the dequantized weights.
The Triton path (``w4_fused_moe_triton``, shared with the NVFP4 experts of ``nvfp4_moe``) follows the FP8
experts of ``moe``: the small path (P <= pair_threshold) a per-(pair, N tile, K split) GEMV whose expert leader
streams the int32 words once for all the expert's pairs (dot rows padded to 16, group scales on the dot's
result), the grouped path ``moe_align`` + a grouped GEMM (scales on the weight tile, rounded to x's dtype),
activation fused into gate|up, then ``moe_reduce``. The kernels: ``_w4_moe_jit``.
"""
from __future__ import annotations

import dataclasses

import torch

from sparrow.kernels.gemm.int4 import dequantize_int4_ref
from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                       dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked int4 experts [E, N, K / 8] -> [E, N, K] in ``dtype``; only the experts listed in ``experts`` are
    dequantized (the others left zero) when it is given."""
    if experts is None:
        return dequantize_int4_ref(w, scale, zero, group).to(dtype)
    out = torch.zeros(w.shape[0], w.shape[1], w.shape[2] * 8, dtype=dtype, device=w.device)
    out[experts] = dequantize_int4_ref(w[experts], scale[experts], None if zero is None else zero[experts],
                                       group).to(dtype)
    return out


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def int4_fused_moe_ref(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                       activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """The torch twin of ``int4_fused_moe`` (module doc)."""
    used = torch.unique(topk_ids.reshape(-1))
    gate_up = dequantize_experts(w13, w13_scale, w13_zero, group, x.dtype, used)
    down = dequantize_experts(w2, w2_scale, w2_zero, group, x.dtype, used)
    path = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
    return path(x, gate_up, down, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce, lora=lora)


def int4_fused_moe(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                   activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """Routed int4 experts; see the module doc. Triton (``int4_fused_moe_triton``) where ``use_triton(x)``.
    ``lora``: per-pair adapter deltas (``sparrow.kernels.moe.moe.fused_moe``'s); on Triton they take every expert
    dequantized to x's dtype (``dequantized_experts``) and the float kernels (``moe.fused_moe``), at every size."""
    from sparrow.kernels import use_triton

    if lora is not None and use_triton(x):
        from sparrow.kernels.moe.moe import fused_moe

        gate_up, down = dequantized_experts(w13.contiguous(), w13_scale.contiguous(), _contiguous(w13_zero), None,
                                            w2.contiguous(), w2_scale.contiguous(), _contiguous(w2_zero), None,
                                            group, x.dtype)
        return fused_moe(x, gate_up, down, topk_weights, topk_ids, activation, pair_threshold=pair_threshold,
                         swiglu_limit=swiglu_limit, reduce=reduce, lora=lora)
    if use_triton(x):
        return int4_fused_moe_triton(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights,
                                     topk_ids, activation, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit,
                                     reduce=reduce)
    return int4_fused_moe_ref(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                              activation, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit, reduce=reduce,
                              lora=lora)


def int4_fused_moe_triton(x, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, group, topk_weights, topk_ids,
                          activation="silu", *, pair_threshold=64, swiglu_limit=None, reduce=True):
    """Triton launcher of ``int4_fused_moe`` (same contract; weights contiguous): ``w4_fused_moe_triton``."""
    return w4_fused_moe_triton(x, w13, w13_scale, w13_zero, None, w2, w2_scale, w2_zero, None, group, topk_weights,
                               topk_ids, activation, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit,
                               reduce=reduce)


_ACT_CODE = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu": 2}

DEQUANT_MIN_ROWS = 1024
"""Rows (tokens) from which the 4-bit experts dequantize every expert to x's dtype (``dequantized_experts``) and
run the float grouped path (``moe.fused_moe_triton``) instead of ``w4_moe_gemm_kernel``; the transient weights
take 2 bytes per element (Gemma 4 26B-A4B: 1.5 GB a layer). Read at each call. On the H200, at one Gemma 4
26B-A4B layer (``benchmarks/moe_layer.py --rows 1024 2048 8192 --dtypes int4 nvfp4 --w4-dequant``), the dequantize
path is the faster from 1,024 rows for int4 and NVFP4 (the figures: benchmarks/README.md, 4-bit weights); smaller row
counts were not measured."""


def dequantized_experts(w13, s13, z13, g13, w2, s2, z2, g2, group, dtype, divide_global=False):
    """(gate_up [E, 2I, H], down [E, H, I]) in ``dtype`` from ``w4_fused_moe_triton``'s operands (int4: ``g13``
    None; NVFP4: the global multipliers g13 [E, 2] per gate / up half, g2 [E, 1]), on Triton
    (``int4.w4_dequantize``): equal to the twins' dequantized experts."""
    from sparrow.kernels.gemm.int4 import w4_dequantize

    width = w13.shape[1] // 2
    return (w4_dequantize(w13, s13, z13, g13, group, dtype, width, divide_global),
            w4_dequantize(w2, s2, z2, g2, group, dtype, w2.shape[1], divide_global))


def _fitted_tile(tile, group: int, nvfp4: bool, small: bool, block_m: int):
    """(tile, sub_k) for one of the 4-bit expert GEMMs: FMA steps take one int4 group each; sub_k, the K step of
    one dequantize, is at most the group (128 for NVFP4). Raises ValueError for a tile the kernels cannot run."""
    from sparrow.kernels.common.tiles import FMA_ROWS

    if small and tile.fma_rows and not nvfp4 and tile.block_k > group:
        tile = dataclasses.replace(tile, block_k=group)
    sub_k = min(tile.block_k, 128 if nvfp4 else group)
    if tile.block_k % sub_k or min(sub_k, tile.block_n, block_m) < 16 or (
            small and tile.fma_rows and tile.fma_rows not in FMA_ROWS):
        raise ValueError(f"int4 / NVFP4 fused_moe: tile {tile} (block_m {block_m}) does not fit group {group} "
                         f"(block_k a multiple of the group or dividing it, tiles >= 16, fma_rows 0 or in {FMA_ROWS})")
    return tile, sub_k


def w4_fused_moe_triton(x, w13, s13, z13, g13, w2, s2, z2, g2, group, topk_weights, topk_ids, activation="silu", *,
                        pair_threshold=64, swiglu_limit=None, reduce=True, divide_global=False):
    """The 4-bit routed experts on Triton, int4 (``g13`` / ``g2`` None) or NVFP4 W4A16 (``kernels.moe.nvfp4_moe``).

    w13 int32 words [E, 2I, H / 8], w2 [E, H, I / 8] (NVFP4: the uint8 codes viewed as int32); int4: s13 / s2 the
    group scales [E, N_w, G], z13 / z2 uint8 zeros or None; NVFP4: s13 / s2 e4m3 [E, N_w, K / 16], g13 fp32 [E, 2]
    and g2 [E, 1] the global multipliers (divisors with ``divide_global``), group 16. Paths as ``moe.fused_moe``:
    P <= min(pair_threshold, moe.SMALL_MAX_PAIRS): ``w4_moe_gemv_kernel`` per (pair, N tile, K split), experts'
    words streamed once for all their pairs; more pairs: ``moe_align`` then ``w4_moe_gemm_kernel`` per block of
    sorted pairs; then ``moe_reduce``. Tiles: ``moe_configs.pick_config`` with kind "int4" / "nvfp4". No host
    sync. Raises ValueError for a tile the kernels cannot run."""
    from sparrow.kernels import interpreting, pdl_kwargs
    from sparrow.kernels.common import split_k
    from sparrow.kernels.moe.moe import SMALL_MAX_PAIRS
    from sparrow.kernels.common.tiles import next_pow2
    from sparrow.kernels.moe.moe_align import moe_align_triton
    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config, pick_config
    from sparrow.kernels.moe.moe_reduce import moe_reduce_triton

    rows, hidden = x.shape
    num_experts, two_width = w13.shape[:2]
    width = two_width // 2
    pairs = topk_ids.numel()
    if rows == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(0, hidden)
    nvfp4 = g13 is not None
    small = pairs <= min(pair_threshold, SMALL_MAX_PAIRS)
    if not small and rows >= DEQUANT_MIN_ROWS and forced_config.value is None:
        from sparrow.kernels.moe.moe import fused_moe_triton

        gate_up, down = dequantized_experts(w13, s13, z13, g13, w2, s2, z2, g2, group, x.dtype, divide_global)
        return fused_moe_triton(x, gate_up, down, topk_weights, topk_ids, activation, pair_threshold=pair_threshold,
                                swiglu_limit=swiglu_limit, reduce=reduce)
    cfg = pick_config(rows, topk_ids.shape[1], num_experts, hidden, width, small, False,
                      torch.cuda.get_device_name(x.device) if x.is_cuda else None, "nvfp4" if nvfp4 else "int4")
    if x.dtype == torch.float32 and x.is_cuda and forced_config.value is None:  # fp32 dots: smaller tiles
        fp32_tile = lambda t: t if t.fma_rows else Tile(32, 64, 4, 2, split_k=t.split_k, swap_ab=True)  # noqa: E731
        cfg = MoeConfig(16, fp32_tile(cfg.gate_up), fp32_tile(cfg.down))
    x = x if x.stride(1) == 1 else x.contiguous()
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)  # [P, I]
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    interp = interpreting()
    common = dict(limit=float(swiglu_limit) if swiglu_limit is not None else 0.0, ACT=_ACT_CODE[activation],
                  HAS_LIMIT=swiglu_limit is not None, NVFP4=nvfp4, DIVIDE_G=divide_global,
                  UPCAST=interp or x.dtype == torch.float32, RNE_BF16=interp and x.dtype == torch.bfloat16)
    gemms = ((x, topk_ids.shape[1], w13, s13, z13, g13, act, width, hidden, True, cfg.gate_up),
             (act, 1, w2, s2, z2, g2, y, hidden, width, False, cfg.down))
    if not small:
        sorted_ids, block_expert, total = moe_align_triton(topk_ids, num_experts, cfg.block_m)
    for a, div, w, s, z, g, out, n, k, gated, tile in gemms:
        tile, sub_k = _fitted_tile(tile, group, nvfp4, small, cfg.block_m)
        args = (a, w, s, z if z is not None else s, g if nvfp4 else s, out)
        strides = (pairs, n, k, div, a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                   g.stride(0) if nvfp4 else 0, group)
        flags = dict(GATED=gated, HAS_ZERO=z is not None, SCALE_W=not small, SWAP_AB=tile.swap_ab, BLOCK_N=tile.block_n,
                     BLOCK_K=tile.block_k, SUB_K=sub_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
                     **common, **pdl_kwargs(x))
        if small:
            from sparrow.kernels.moe._w4_moe_jit import w4_moe_gemv_kernel

            block_r = min(next_pow2(pairs), next_pow2(rows))  # an expert appears once per row at most
            block_r = min(block_r, tile.fma_rows) if tile.fma_rows else max(16, block_r)
            n_tiles = -(-n // tile.block_n)
            split, ws, locks = split_k.plan(x.device, pairs * n_tiles, -(-k // tile.block_k), tile.split_k,
                                            (2 if gated else 1) * block_r * tile.block_n, out)
            w4_moe_gemv_kernel[(pairs, n_tiles, split)](
                *args, topk_ids.reshape(-1), ws, locks, *strides, P_PAD=next_pow2(pairs), BLOCK_R=block_r,
                SPLIT_K=split, FMA=tile.fma_rows > 0, **flags)
        else:
            from sparrow.kernels.moe._w4_moe_jit import w4_moe_gemm_kernel

            w4_moe_gemm_kernel[(block_expert.numel(), -(-n // tile.block_n))](
                *args, sorted_ids, block_expert, total, *strides, BLOCK_M=cfg.block_m, **flags)
    return moe_reduce_triton(y, topk_weights, x.dtype) if reduce else y
