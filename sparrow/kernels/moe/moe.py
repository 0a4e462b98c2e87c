"""Fused MoE experts: launchers, torch twins and the dispatcher.

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K (row, expert) pairs
(pair p = row p // K, slot p % K), BM = BLOCK_M, S = padded sorted length, NB = S // BM.

    fused_moe(x [R, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], topk_weights [R, K], topk_ids [R, K],
              activation="silu", *, w13_scale=None, w2_scale=None, pair_threshold=64, swiglu_limit=None,
              reduce=True) -> [R, H] in x's dtype

    out[r] = sum_k topk_weights[r, k] * down[e] @ act(gate[e] @ x[r]) * (up[e] @ x[r]),  e = topk_ids[r, k]

Weights are x's dtype (bf16 / fp16 / fp32), or FP8: e4m3 with ``w13_scale`` [E, ceil(2I/128), ceil(H/128)]
and ``w2_scale`` [E, ceil(H/128), ceil(I/128)] fp32 (128 x 128 block scales, DeepSeek / Qwen
``weight_scale_inv``, fp8.py), W8A8: x and the intermediate are quantized per 128-column group as
``fp8.quantize_fp8_per_group_ref`` does. ``activation``: silu / swish, gelu_pytorch_tanh, gelu;
``swiglu_limit``: DeepSeek-V4's clamp (gate <= limit, |up| <= limit).

Paths (``fused_moe`` picks by P vs ``pair_threshold``, Triton where ``use_triton(x)``):
- grouped (prefill): ``moe_align`` (sort pairs by expert, pad segments to BM; device-only, fixed-size
  buffers, CUDA-graph safe) -> grouped GEMM gate|up + activation [P, I] -> grouped GEMM down [P, H] ->
  ``moe_reduce`` (weighted sum over K back to row order);
- small (decode, P <= SMALL_MAX_PAIRS): per-expert GEMV kernels (no sort; each selected expert's weights
  streamed once for all the rows that picked it) -> the same ``moe_reduce``.
Accumulation is fp32; the intermediate [P, I] and the per-pair outputs [P, H] are rounded to x's dtype
(like the references); act(gate) * up is computed from fp32 accumulators and rounded once; the reduce
is fp32 with one final rounding. No launch synchronizes with the host.

Modules: this one holds the experts' launcher ``fused_moe_triton`` and the dispatcher ``fused_moe``;
``moe_align`` and ``moe_reduce`` (each with its twin and launcher) have their own modules, and the torch
twins of the experts (the CPU path and the oracle: ``fused_moe_ref``, which picks ``fused_moe_grouped_ref`` /
``fused_moe_per_pair_ref`` for x-dtype weights and ``fused_moe_fp8_ref`` for FP8) live in ``moe_ref``; all
are importable from here. Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import dataclasses

import torch

from sparrow.kernels import dispatch, interpreting as _interpret, pdl_kwargs
from sparrow.kernels.common import split_k
from sparrow.kernels.common.tiles import next_pow2
from sparrow.kernels.gemm.fp8 import GROUP
from sparrow.kernels.moe.moe_align import align_sizes, moe_align, moe_align_ref, moe_align_triton
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, pick_config
from sparrow.kernels.moe.moe_reduce import moe_reduce, moe_reduce_ref, moe_reduce_triton
from sparrow.kernels.moe.moe_ref import _check_moe, fused_moe_fp8_ref, fused_moe_grouped_ref, fused_moe_per_pair_ref, \
    fused_moe_ref


def _fp32_config(cfg: MoeConfig, fp8: bool) -> MoeConfig:
    """The config scaled down for fp32 operands (twice the bytes of bf16 per tile); FP8 weights keep K steps
    of whole 128-column scale groups (their weight tile is a quarter of the fp32 one), only fewer stages."""
    def shrink(t: Tile) -> Tile:
        block_k = max(GROUP if fp8 else 16, t.block_k // 2)
        return dataclasses.replace(t, block_k=block_k, num_stages=min(t.num_stages, 2))

    return MoeConfig(cfg.block_m, shrink(cfg.gate_up), shrink(cfg.down))


SMALL_MAX_PAIRS = 256  # the small path holds all pair ids of the batch in one program
_ACT_CODE = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu": 2}  # the kernels' ACT constexpr


def fused_moe_triton(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", *, w13_scale=None,
                     w2_scale=None, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """Triton launcher of ``fused_moe`` (same contract): the small path for P <= pair_threshold (and
    <= SMALL_MAX_PAIRS), the grouped path above; 3 launches small, 6 grouped (one more per FP8 GEMM whose
    tile has ``a_fp8``: its activation quantizer), no host sync. ``lora``: per-pair adapter deltas
    (``sparrow.layers.lora_buffers.ExpertDelta``): gate_up's [P, 2I] fp32 enters the gate|up kernel's epilogue (added to
    its accumulators before the activation), down's is added to the per-pair outputs before the reduce."""
    _check_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    rows, hidden = x.shape
    num_experts, two_width = gate_up_proj.shape[:2]
    width = two_width // 2
    pairs = topk_ids.numel()
    if rows == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(0, hidden)
    small = pairs <= min(pair_threshold, SMALL_MAX_PAIRS)
    fp8 = w13_scale is not None
    cfg = pick_config(rows, topk_ids.shape[1], num_experts, hidden, width, small, fp8,
                      torch.cuda.get_device_name(x.device) if x.is_cuda else None)
    if x.dtype == torch.float32 and x.is_cuda:  # 4-byte tiles: halve K and the pipeline depth so the
        cfg = _fp32_config(cfg, fp8)                 # stages fit in shared memory (228 KB on H100/H200)
    _check_config(cfg, fp8)
    x = x if x.stride(1) == 1 else x.contiguous()
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)  # [P, I]
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    h_delta = lora.gate_up(x) if lora is not None else None  # [P, 2I] fp32
    common = dict(limit=float(swiglu_limit) if swiglu_limit is not None else 0.0,
                  HAS_LIMIT=swiglu_limit is not None, ACT=_ACT_CODE[activation], FP8_W=fp8,
                  EMULATE_FP8=_interpret(), UPCAST=_interpret() or x.dtype == torch.float32,
                  RNE_BF16=_interpret() and x.dtype == torch.bfloat16)
    gemms = (  # (a, a_row_div, w, scale, out, n, k, gated, tile, delta)
        (x, topk_ids.shape[1], gate_up_proj, w13_scale, act, width, hidden, True, cfg.gate_up, h_delta),
        (act, 1, down_proj, w2_scale, y, hidden, width, False, cfg.down, None),
    )
    if small:
        from sparrow.kernels.moe._moe_jit import moe_gemv_kernel

        flat_ids = topk_ids.reshape(-1)
        p_pad = next_pow2(pairs)
        block_r = max(16, min(p_pad, next_pow2(rows)))  # an expert appears at most once per row
        for a, div, w, s, out, n, k, gated, tile, delta in gemms:
            tile = _fit_shared_memory(tile, block_r, a.element_size(), w.element_size(), gated)
            n_tiles = -(-n // tile.block_n)
            split, ws, locks = split_k.plan(x.device, pairs * n_tiles, -(-k // tile.block_k), tile.split_k,
                                            (2 if gated else 1) * block_r * tile.block_n, out)
            moe_gemv_kernel[(pairs, n_tiles, split)](
                a, w, s if fp8 else w, out, delta if delta is not None else out, flat_ids, ws, locks,
                pairs, n, k, div, a.stride(0), w.stride(0), w.stride(1),
                s.stride(0) if fp8 else 0, s.stride(1) if fp8 else 0, GATED=gated, HAS_DELTA=delta is not None,
                P_PAD=p_pad,
                BLOCK_R=block_r, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                SUB_K=min(tile.block_k, GROUP) if fp8 else tile.block_k, SPLIT_K=split, SWAP_AB=tile.swap_ab,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **common, **pdl_kwargs(x),
            )
    else:
        from sparrow.kernels.moe._moe_jit import moe_gemm_kernel

        from sparrow.kernels.gemm.scaled_mm import quantize_fp8_per_group_triton

        sorted_ids, block_expert, total = moe_align_triton(topk_ids, num_experts, cfg.block_m)
        for a, div, w, s, out, n, k, gated, tile, delta in gemms:
            a_fp8 = fp8 and tile.a_fp8
            a, a_s = quantize_fp8_per_group_triton(a) if a_fp8 else (a, a)  # e4m3 a + [rows, G] scales
            moe_gemm_kernel[(block_expert.numel(), -(-n // tile.block_n))](
                a, a_s, w, s if fp8 else w, out, delta if delta is not None else out, sorted_ids, block_expert,
                total, pairs, n, k, div, a.stride(0),
                a_s.stride(0) if a_fp8 else 0, w.stride(0), w.stride(1), s.stride(0) if fp8 else 0,
                s.stride(1) if fp8 else 0, GATED=gated, HAS_DELTA=delta is not None, BLOCK_M=cfg.block_m,
                BLOCK_N=tile.block_n,
                BLOCK_K=tile.block_k, SUB_K=min(tile.block_k, GROUP) if fp8 else tile.block_k,
                SWAP_AB=tile.swap_ab, A_FP8=a_fp8,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **common, **pdl_kwargs(x),
            )
    if lora is not None:
        y = lora.down(act, y)
    return moe_reduce_triton(y, topk_weights, x.dtype) if reduce else y


fused_moe = dispatch("fused_moe", fused_moe_triton, fused_moe_ref, """Routed experts of x [R, H] -> [R, H] in x's
    dtype (``fused_moe_ref``'s signature); see the module doc. ``reduce=False``: the unweighted per-pair outputs
    [P, H] in pair order instead, for a consumer that fuses the weighted reduce (``moe_reduce``'s y). Triton where
    ``use_triton(x)``, else ``fused_moe_ref``. Raises ValueError on bad shapes / dtypes.""")


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (H100 / H200 allow 227 KB)


def _fit_shared_memory(tile, block_r: int, a_bytes: int, w_bytes: int, gated: bool):
    """The tile with fewer pipeline stages if its stages would exceed SHARED_MEMORY_BUDGET: each stage holds a
    [block_r, block_k] A tile and one (two when gated) [block_k, block_n] weight tiles. The small path's
    block_r grows with the batch, so a tile tuned for a few rows can overflow at a forced 65+ rows."""
    per_stage = block_r * tile.block_k * a_bytes + (2 if gated else 1) * tile.block_k * tile.block_n * w_bytes
    stages = tile.num_stages
    while stages > 1 and stages * per_stage > SHARED_MEMORY_BUDGET:
        stages -= 1
    return tile if stages == tile.num_stages else dataclasses.replace(tile, num_stages=stages)


def _check_config(cfg: MoeConfig, fp8: bool) -> None:
    for name, tile in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        if fp8 and tile.block_k % GROUP:
            raise ValueError(f"fused_moe: FP8 needs {name}.block_k a multiple of {GROUP}, got {tile.block_k}")
        if min(tile.block_n, tile.block_k, cfg.block_m) < 16:
            raise ValueError(f"fused_moe: tile sizes must be >= 16 (tl.dot), got {cfg}")


__all__ = [
    "align_sizes", "fused_moe", "fused_moe_fp8_ref", "fused_moe_grouped_ref", "fused_moe_per_pair_ref",
    "fused_moe_ref", "fused_moe_triton",
    "moe_align", "moe_align_ref", "moe_align_triton", "moe_reduce", "moe_reduce_ref", "moe_reduce_triton",
]
