"""GGUF routed experts on raw ggml blocks: the torch twin, the Triton launcher and the dispatcher.

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K pairs; a type t has B elements
and T bytes a block (``gguf_blocks.block_bytes``: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 B = 32, Q2_K .. Q6_K B = 256).

    gguf_fused_moe(x [R, H], w13 uint8 [E, 2I, H / B1 * T1], w13_type, w2 uint8 [E, H, I / B2 * T2], w2_type,
                   topk_weights [R, K], topk_ids [R, K], activation="silu", *, pair_threshold=64,
                   swiglu_limit=None, reduce=True, lora=None)
        -> [R, H] in x's dtype (or the unweighted per-pair outputs [P, H] with reduce=False)

Each weight row is its ggml blocks as stored in the GGUF file (ggml-common.h block_q4_0 .. block_q6_K; w13 the
gate rows 0 .. I-1, then the up rows), so H must be a multiple of B1 and I of B2; the two types may differ (gemma4
26B-A4B: Q4_K gate|up, Q8_0 down as I = 704 is no multiple of 256). ``activation``, ``swiglu_limit``, ``reduce``
and ``lora`` as ``moe.fused_moe``.

The twin ``gguf_fused_moe_ref`` dequantizes the used experts (``gguf_blocks.dequantize``, bit-exact with gguf-py)
to x's dtype and runs the float twins of ``moe_ref`` (grouped for P > pair_threshold, per pair otherwise).

The Triton path (``gguf_fused_moe_triton``, bodies in ``_gguf_moe_jit``) never writes a float weight: each program
dequantizes its weight tiles in registers (``dequant_tile``) and multiplies them at once.
- small path (P <= min(pair_threshold, moe.SMALL_MAX_PAIRS), decode): program per (pair, N tile, K split); the
  first pair of each expert leads and the others exit, so each used expert's blocks are read once per BLOCK_R of
  its pairs (an expert has at most R pairs: up to 4 rows, ``Tile.fma_rows`` rows of fp32 FMAs on the exact fp32
  weights, so once; from 5 rows dots on 16 padded rows), as BN contiguous row segments of BLOCK_K / B blocks
  (coalesced); automatic split-K (``split_k.plan``) fills the GPU (gemma4 at R = 1: 8 experts x 22 gate|up tiles
  of 32 rows x splits), reduced in the kernel; act(gate) * up fused in the gate|up store; then ``moe_reduce``.
  Three launches, no host sync (CUDA-graph safe).
- grouped path: ``moe_align`` then one grouped GEMM per projection (each block of BLOCK_M sorted pairs
  dequantizes its expert's tiles once, rounded to x's dtype for tl.dot), then ``moe_reduce``. Six launches.
BLOCK_K is the tile's, halved until it divides the GEMM's K (>= 32: whole 32-element groups, no tail tile).

To tune on the GPU (``moe_configs.forced_config``; tuned files
``configs/E{E}_H{H}_I{I}_gguf_{w13 type}_{w2 type}_{device}.json``): BLOCK_N / BLOCK_K per type pair, num_warps
and num_stages of the byte loads, the split-K target (``split_k.FILL_PROGRAMS``), FMA rows vs dots for 2-4
rows, swapped dots and BLOCK_M on the grouped path, and the row count from which dequantizing the experts once
to x's dtype and running the float grouped GEMM wins (``int4_moe.DEQUANT_MIN_ROWS``'s trade). None measured yet.

Errors: UnsupportedGGUFTypeError for a type outside GGUF_MOE_TYPES, ModelLoadError naming the weight for a
shape or byte count that does not fit x and the type, ValueError for bad x / routing / activation.
"""
from __future__ import annotations

import dataclasses

import torch
from gguf.constants import GGMLQuantizationType as T

from sparrow.errors import ModelLoadError, UnsupportedGGUFTypeError
from sparrow.kernels.common.gguf_blocks import block_bytes, dequantize
from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref

GGUF_MOE_TYPES = frozenset((T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))
"""ggml block types the GGUF expert kernels read."""

_DEQUANT_EXPERTS = 8  # experts per gguf_blocks.dequantize call (bounds its fp32 temporaries)


def _type_name(ggml_type) -> str:
    try:
        return T(ggml_type).name
    except ValueError:
        return f"ggml type {int(ggml_type)}"


def _check_weight(name: str, w: torch.Tensor, ggml_type, rows: int, cols: int, num_experts: int | None) -> None:
    """w must be uint8 [E, rows, cols / B * T] of a type in GGUF_MOE_TYPES with cols a multiple of B."""
    if ggml_type not in GGUF_MOE_TYPES:
        names = ", ".join(sorted(t.name for t in GGUF_MOE_TYPES))
        raise UnsupportedGGUFTypeError(f"gguf_fused_moe: {name} is {_type_name(ggml_type)}; the GGUF expert "
                                       f"kernels read {names}")
    elems, nbytes = block_bytes(ggml_type)
    kind = _type_name(ggml_type)
    if cols % elems:
        raise ModelLoadError(f"gguf_fused_moe: {name} ({kind}) rows of {cols} elements are not whole "
                             f"{elems}-element blocks")
    want = cols // elems * nbytes
    if w.dtype != torch.uint8 or w.dim() != 3:
        raise ModelLoadError(f"gguf_fused_moe: {name} must be the raw blocks, uint8 [E, N, bytes], got {w.dtype} "
                             f"{tuple(w.shape)}")
    if w.shape[1] != rows or w.shape[2] != want or (num_experts is not None and w.shape[0] != num_experts):
        experts = "E" if num_experts is None else num_experts
        raise ModelLoadError(f"gguf_fused_moe: {name} ({kind}) must be [{experts}, {rows}, {want}] bytes "
                             f"({cols} elements a row), got {tuple(w.shape)}")


def _check(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation) -> tuple[int, int]:
    """(hidden, width) of a valid call; raises the module doc's errors."""
    from sparrow.kernels.moe.moe_ref import check_routing

    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"gguf_fused_moe: x must be [R, H] fp32 / bf16 / fp16, got {tuple(x.shape)} {x.dtype}")
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ModelLoadError(f"gguf_fused_moe: w13 must be uint8 [E, 2I, bytes], got {tuple(w13.shape)}")
    hidden, width = x.shape[1], w13.shape[1] // 2
    _check_weight("w13", w13, w13_type, 2 * width, hidden, None)
    _check_weight("w2", w2, w2_type, hidden, width, w13.shape[0])
    check_routing("gguf_fused_moe", x.shape[0], topk_weights, topk_ids, activation)
    for name, t in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"gguf_fused_moe: {name} is on {t.device}, x on {x.device}")
    return hidden, width


def dequantize_gguf_experts(w: torch.Tensor, ggml_type, cols: int, dtype: torch.dtype,
                            experts: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked GGUF experts uint8 [E, N, cols / B * T] -> [E, N, cols] in ``dtype`` (``gguf_blocks.dequantize``,
    bit-exact fp32, then rounded); only the experts listed in ``experts`` (the others zero) when given."""
    num, rows = w.shape[:2]
    if experts is None:
        out = torch.empty(num, rows, cols, dtype=dtype, device=w.device)
        for e in range(0, num, _DEQUANT_EXPERTS):
            part = w[e:e + _DEQUANT_EXPERTS]
            out[e:e + _DEQUANT_EXPERTS] = dequantize(part, ggml_type, (part.shape[0], rows, cols)).to(dtype)
        return out
    out = torch.zeros(num, rows, cols, dtype=dtype, device=w.device)
    out[experts] = dequantize(w[experts], ggml_type, (experts.numel(), rows, cols)).to(dtype)
    return out


def gguf_fused_moe_ref(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation="silu", *,
                       pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """The torch twin of ``gguf_fused_moe`` (module doc)."""
    hidden, width = _check(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation)
    if x.shape[0] == 0:  # as the launcher (moe_ref's twins cannot view 0 rows as [0, K, H])
        return torch.zeros_like(x) if reduce else x.new_zeros(0, hidden)
    used = torch.unique(topk_ids.reshape(-1))
    gate_up = dequantize_gguf_experts(w13, w13_type, hidden, x.dtype, used)
    down = dequantize_gguf_experts(w2, w2_type, width, x.dtype, used)
    path = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
    return path(x, gate_up, down, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce, lora=lora)


def gguf_fused_moe(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation="silu", *, pair_threshold=64,
                   swiglu_limit=None, reduce=True, lora=None):
    """Routed GGUF experts; see the module doc. Triton (``gguf_fused_moe_triton``) where ``use_triton(x)``, else
    the twin. ``lora``: per-pair adapter deltas (``moe.fused_moe``'s); on Triton, as the int4 experts, they take
    every expert dequantized to x's dtype (``dequantize_gguf_experts``, a transient [E, 2I, H] + [E, H, I] copy of
    this layer) and the float kernels (``moe.fused_moe``), at every size."""
    from sparrow.kernels import use_triton

    if lora is not None and use_triton(x):
        from sparrow.kernels.moe.moe import fused_moe

        hidden, width = _check(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation)
        gate_up = dequantize_gguf_experts(w13, w13_type, hidden, x.dtype)
        down = dequantize_gguf_experts(w2, w2_type, width, x.dtype)
        return fused_moe(x, gate_up, down, topk_weights, topk_ids, activation, pair_threshold=pair_threshold,
                         swiglu_limit=swiglu_limit, reduce=reduce, lora=lora)
    fn = gguf_fused_moe_triton if use_triton(x) else gguf_fused_moe_ref
    extra = {} if lora is None else {"lora": lora}
    return fn(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation, pair_threshold=pair_threshold,
              swiglu_limit=swiglu_limit, reduce=reduce, **extra)


def default_gguf_config(rows: int, pairs: int, num_experts: int, small: bool):
    """Heuristic tiles, chosen from sm_90 builds on a machine without a GPU (ptxas register and spill counts of
    Triton 3.9's code for Q4_K gate|up and Q8_0 / Q6_K down; not timed yet). The dequantized fp32 tile lives in
    registers, so tiles stay small. Small path: up to 2 rows fp32 FMAs on 32 x 64 tiles, 3-4 rows on 16 x 64
    (``fma_rows`` 4), 8 warps (Q4_K gate|up: 128 registers at 1 row, 174 at 2, 103 at 4, no spills; 32 x 128
    tiles or 4 warps spill); from 5 rows swapped 64 x 32 dots on 16 padded rows, 8 warps (180 registers on Q4_K
    gate|up); automatic split-K. Grouped path: BLOCK_M 16 / 32 / 64 by the mean pairs an expert (as the float
    and 4-bit experts), swapped 64 x 32 tiles on 8 warps (<= 190 registers, no spills; the 4-bit experts'
    64 x 128 / 128 x 64 tiles spill on ggml tiles)."""
    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile

    if small and rows <= 2:
        tile = Tile(block_n=32, block_k=64, num_warps=8, num_stages=2, split_k=0, fma_rows=rows)
    elif small and rows <= 4:
        tile = Tile(block_n=16, block_k=64, num_warps=8, num_stages=2, split_k=0, fma_rows=4)
    else:
        tile = Tile(block_n=64, block_k=32, num_warps=8, num_stages=2, split_k=0, swap_ab=True)
    per_expert = pairs / max(num_experts, 1)
    block_m = 16 if small or per_expert <= 16 else 32 if per_expert <= 48 else 64
    return MoeConfig(block_m, tile, tile)


def _pick_config(x, topk_ids, num_experts, hidden, width, small, kind: str):
    """The forced config, else the nearest row count of the tuned file of ``kind`` (``gguf_{w13 type}_{w2 type}``;
    the grouped path skips FMA entries, as ``moe_configs.pick_config`` does), else ``default_gguf_config``."""
    from sparrow.kernels.moe.moe_configs import forced_config, tuned_configs

    rows = x.shape[0]
    if forced_config.value is not None:
        return forced_config.value
    if x.is_cuda:
        table = tuned_configs(num_experts, hidden, width, False, torch.cuda.get_device_name(x.device), kind)
        if not small:
            table = {r: c for r, c in table.items() if not (c.gate_up.fma_rows or c.down.fma_rows)}
        if table:
            return table[min(table, key=lambda r: (abs(r - rows), r))]
    return default_gguf_config(rows, topk_ids.numel(), num_experts, small)


def _fit(tile, k: int, fp32_cuda: bool):
    """The tile with BLOCK_K halved until it divides k (>= 32: k is a multiple of 32) and, for fp32 operands on a
    GPU, at most 64 x 64 with 2 stages (4-byte tiles). Raises ValueError for a tile the kernels cannot run."""
    from sparrow.kernels.common.tiles import FMA_ROWS

    block_k = tile.block_k
    while block_k > 32 and k % block_k:
        block_k //= 2
    if block_k < 32 or k % block_k or tile.block_n < 16 or (tile.fma_rows and tile.fma_rows not in FMA_ROWS):
        raise ValueError(f"gguf_fused_moe: tile {tile} does not fit K = {k} (block_k a power of two >= 32, "
                         f"block_n >= 16, fma_rows 0 or in {FMA_ROWS})")
    if fp32_cuda and not tile.fma_rows:
        return dataclasses.replace(tile, block_n=min(tile.block_n, 64), block_k=min(block_k, 64),
                                   num_stages=min(tile.num_stages, 2))
    return dataclasses.replace(tile, block_k=block_k)


def gguf_fused_moe_triton(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation="silu", *,
                          pair_threshold=64, swiglu_limit=None, reduce=True):
    """Triton launcher of ``gguf_fused_moe`` (same contract; the module doc's paths). Tiles: ``_pick_config``
    (``moe_configs.forced_config`` wins). No host sync. Raises as the module doc says, ValueError for a forced
    tile the kernels cannot run."""
    from sparrow.kernels import interpreting, pdl_kwargs
    from sparrow.kernels.moe.moe import SMALL_MAX_PAIRS, _ACT_CODE
    from sparrow.kernels.moe.moe_align import moe_align_triton
    from sparrow.kernels.moe.moe_reduce import moe_reduce_triton

    hidden, width = _check(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids, activation)
    rows, pairs, num_experts = x.shape[0], topk_ids.numel(), w13.shape[0]
    if rows == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(0, hidden)
    small = pairs <= min(pair_threshold, SMALL_MAX_PAIRS)
    cfg = _pick_config(x, topk_ids, num_experts, hidden, width, small,
                       f"gguf_{_type_name(w13_type)}_{_type_name(w2_type)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)  # [P, I]
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    interp = interpreting()
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    common = dict(ACT=_ACT_CODE[activation], HAS_LIMIT=swiglu_limit is not None,
                  UPCAST=interp or x.dtype == torch.float32,
                  RNE_BF16=interp and x.dtype == torch.bfloat16, **pdl_kwargs(x))
    gemms = ((x, topk_ids.shape[1], w13, w13_type, act, width, hidden, True, cfg.gate_up),
             (act, 1, w2, w2_type, y, hidden, width, False, cfg.down))
    align = None if small else moe_align_triton(topk_ids, num_experts, cfg.block_m)
    for a, div, w, wtype, out, n, k, gated, tile in gemms:
        tile = _fit(tile, k, x.is_cuda and x.dtype == torch.float32)
        args = (a, w, out)
        strides = (pairs, n, k, div, a.stride(0), w.stride(0), w.stride(1), limit)
        flags = dict(GGML_TYPE=int(wtype), GATED=gated, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                     SWAP_AB=tile.swap_ab, num_warps=tile.num_warps, num_stages=tile.num_stages, **common)
        if small:
            _launch_small(args, strides, flags, tile, topk_ids, rows, pairs, n, k, gated)
        else:
            from sparrow.kernels.moe._gguf_moe_jit import gguf_moe_gemm_kernel

            sorted_ids, block_expert, total = align
            gguf_moe_gemm_kernel[(block_expert.numel(), -(-n // tile.block_n))](
                *args, sorted_ids, block_expert, total, *strides, BLOCK_M=cfg.block_m, **flags)
    return moe_reduce_triton(y, topk_weights, x.dtype) if reduce else y


def _launch_small(args, strides, flags, tile, topk_ids, rows, pairs, n, k, gated):
    """One small-path GEMM (``gguf_moe_gemv_kernel``): BLOCK_R dot rows (>= 16) or ``tile.fma_rows`` FMA rows per
    pass of an expert's pairs, the split-K plan of ``split_k.plan``."""
    from sparrow.kernels.common import split_k
    from sparrow.kernels.common.tiles import next_pow2
    from sparrow.kernels.moe._gguf_moe_jit import gguf_moe_gemv_kernel

    block_r = min(next_pow2(pairs), next_pow2(rows))  # an expert appears once per row at most
    block_r = min(block_r, tile.fma_rows) if tile.fma_rows else max(16, block_r)
    n_tiles = -(-n // tile.block_n)
    out = args[2]
    split, ws, locks = split_k.plan(out.device, pairs * n_tiles, k // tile.block_k, tile.split_k,
                                    (2 if gated else 1) * block_r * tile.block_n, out)
    gguf_moe_gemv_kernel[(pairs, n_tiles, split)](
        *args, topk_ids.reshape(-1), ws, locks, *strides, P_PAD=next_pow2(pairs), BLOCK_R=block_r, SPLIT_K=split,
        FMA=tile.fma_rows > 0, **flags)
