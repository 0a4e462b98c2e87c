"""Fused MoE experts: launchers, torch twins and the dispatcher (design §3, FP8 of §4).

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K (row, expert) pairs
(pair p = row p // K, slot p % K), BM = BLOCK_M, S = padded sorted length, NB = S // BM.

    fused_moe(x [R, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], topk_weights [R, K], topk_ids [R, K],
              activation="silu", *, w13_scale=None, w2_scale=None, pair_threshold=64, swiglu_limit=None,
              shared_output=None, shared_gate=None) -> [R, H] in x's dtype

    out[r] = sum_k topk_weights[r, k] * down[e] @ act(gate[e] @ x[r]) * (up[e] @ x[r]),  e = topk_ids[r, k]
             (+ sigmoid(shared_gate[r]) * shared_output[r], or + shared_output[r] without a gate)

Weights are x's dtype (bf16 / fp16 / fp32), or FP8: e4m3 with ``w13_scale`` [E, ceil(2I/128), ceil(H/128)]
and ``w2_scale`` [E, ceil(H/128), ceil(I/128)] fp32 (128 x 128 block scales, DeepSeek / Qwen
``weight_scale_inv``, fp8.py), W8A8: x and the intermediate are quantized per 128-column group as
``fp8.quantize_fp8_per_group_ref`` does. ``activation``: silu / swish, gelu_pytorch_tanh, gelu;
``swiglu_limit``: DeepSeek-V4's clamp (gate <= limit, |up| <= limit).

Paths (``fused_moe`` picks by P vs ``pair_threshold``, Triton where ``use_triton(x)``):
- grouped (prefill): ``moe_align`` (sort pairs by expert, pad segments to BM; device-only, fixed-size
  buffers, CUDA-graph safe) -> grouped GEMM gate|up + activation [P, I] -> grouped GEMM down [P, H] ->
  ``moe_reduce`` (weighted sum over K back to row order, shared-expert blend fused);
- small (decode, P <= SMALL_MAX_PAIRS): per-expert GEMV kernels (no sort; each selected expert's weights
  streamed once for all the rows that picked it) -> the same ``moe_reduce``.
Accumulation is fp32; the intermediate [P, I] and the per-pair outputs [P, H] are rounded to x's dtype
(like the references); act(gate) * up is computed from fp32 accumulators and rounded once; the reduce
is fp32 with one final rounding. No launch synchronizes with the host.

Torch twins (the CPU path and the oracle): bf16 / fp32 weights -> ``fused_moe_grouped_ref`` /
``fused_moe_per_pair_ref`` of ``sparrow.layers.moe``; FP8 -> ``fused_moe_fp8_ref`` (W8A8 with the
dequantized weights); ``moe_align_ref``, ``moe_reduce_ref``. Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import dataclasses

import torch

from sparrow.kernels import interpreting as _interpret, pdl_kwargs, prefetch_bytes, split_k, use_triton
from sparrow.kernels.fp8 import FP8_DTYPE, GROUP, dequantize_fp8_block_ref, dequantize_fp8_per_group_ref, \
    quantize_fp8_per_group_ref
from sparrow.kernels.moe_configs import MoeConfig, Tile, pick_config
from sparrow.layers.moe import _gate_up_act, fused_moe_grouped_ref, fused_moe_per_pair_ref


def _fp32_config(cfg: MoeConfig, fp8: bool) -> MoeConfig:
    """The config scaled down for fp32 operands (twice the bytes of bf16 per tile); FP8 weights keep K steps
    of whole 128-column scale groups (their weight tile is a quarter of the fp32 one), only fewer stages."""
    def shrink(t: Tile) -> Tile:
        block_k = max(GROUP if fp8 else 16, t.block_k // 2)
        return dataclasses.replace(t, block_k=block_k, num_stages=min(t.num_stages, 2))

    return MoeConfig(cfg.block_m, shrink(cfg.gate_up), shrink(cfg.down))


SMALL_MAX_PAIRS = 256  # the small path holds all pair ids of the batch in one program
_ACT_CODE = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu": 2}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------- align


def align_sizes(pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(S, NB): worst-case padded length and block count for P pairs over E experts, BM-aligned.
    At most min(E, P) experts are non-empty, each padded by < BM: S = ceil((P + min(E, P)(BM-1)) / BM) BM."""
    nb = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    return nb * block_m, nb


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort pairs by expert and pad each expert's segment to a multiple of ``block_m``.

    topk_ids [R, K] int (each in [0, E)) -> (sorted_ids [S] int32: pair ids, stable within an expert,
    padding = P; block_expert [NB] int32: expert of each BM block, -1 past the padded total;
    total [1] int32: the padded total). S, NB from ``align_sizes``.
    """
    _check_align(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    size, nblocks = align_sizes(pairs, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)
    start = end - padded
    order = torch.argsort(flat, stable=True)
    first_sorted = torch.cumsum(counts, 0) - counts  # [E] sorted index of each expert's first pair
    e_sorted = flat[order]
    pos = start[e_sorted] + torch.arange(pairs, device=flat.device) - first_sorted[e_sorted]
    sorted_ids = torch.full((size,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[pos] = order.to(torch.int32)
    total = padded.sum()
    block_pos = torch.arange(nblocks, device=flat.device) * block_m
    owner = torch.searchsorted(end, block_pos, right=True)
    block_expert = torch.where(block_pos < total, owner, -1).to(torch.int32)
    return sorted_ids, block_expert, total.reshape(1).to(torch.int32)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``moe_align_ref`` (same contract): three launches, no host sync."""
    from sparrow.kernels._moe_jit import align_count_kernel, align_offsets_kernel, align_scatter_kernel

    _check_align(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    size, nblocks = align_sizes(pairs, num_experts, block_m)
    e_pad = _next_pow2(num_experts)
    block_p = max(16, min(128, 8192 // e_pad))
    chunks = max(1, -(-pairs // block_p))
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    chunk_off = torch.empty_like(counts)
    rank = torch.empty(max(pairs, 1), dtype=torch.int32, device=dev)
    start = torch.empty(e_pad, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    warps = 8 if e_pad >= 256 else 4
    align_count_kernel[(chunks,)](flat, counts, rank, pairs, BLOCK_P=block_p, E_PAD=e_pad, num_warps=warps)
    align_offsets_kernel[(1,)](counts, chunk_off, start, sorted_ids, block_expert, total, chunks, pairs, size,
                               nblocks, BLOCK_M=block_m, E_PAD=e_pad, BLOCK_S=256, num_warps=warps)
    if pairs:
        align_scatter_kernel[(chunks,)](flat, rank, chunk_off, start, sorted_ids, pairs, BLOCK_P=block_p,
                                        E_PAD=e_pad, num_warps=warps)
    return sorted_ids, block_expert, total


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``moe_align_triton`` where ``use_triton(topk_ids)``, else ``moe_align_ref``."""
    return (moe_align_triton if use_triton(topk_ids) else moe_align_ref)(topk_ids, num_experts, block_m)


# ------------------------------------------------------------------------------------------ reduce


def moe_reduce_ref(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype | None = None,
                   shared_output: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Unpermute + weighted reduce: y [P, H] (pair order) , topk_weights [R, K] -> [R, H] in ``out_dtype``
    (default y's): sum_k w[r, k] y[r K + k] in fp32 (+ sigmoid(shared_gate [R] or [R, 1]) * shared_output
    [R, H], or + shared_output without a gate), rounded once."""
    rows, top_k = _check_reduce(y, topk_weights, shared_output, shared_gate)
    out = (y.float().view(rows, top_k, -1) * topk_weights.float().unsqueeze(-1)).sum(dim=1)
    return _blend_ref(out, shared_output, shared_gate).to(out_dtype or y.dtype)


def moe_reduce_triton(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype | None = None,
                      shared_output: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Triton launcher of ``moe_reduce_ref`` (same contract); one program per (row, BLOCK_H columns)."""
    from sparrow.kernels._moe_jit import moe_reduce_kernel

    rows, top_k = _check_reduce(y, topk_weights, shared_output, shared_gate)
    hidden = y.shape[1]
    out = torch.empty(rows, hidden, dtype=out_dtype or y.dtype, device=y.device)
    if rows == 0 or hidden == 0:
        return out
    y = y.contiguous()
    w = topk_weights if topk_weights.stride(-1) == 1 else topk_weights.contiguous()
    gate = shared_gate.reshape(rows) if shared_gate is not None else None
    block_h = min(1024, _next_pow2(hidden))
    moe_reduce_kernel[(rows, -(-hidden // block_h))](
        y, w, out, shared_output if shared_output is not None else out, gate if gate is not None else w,
        hidden, w.stride(0), shared_output.stride(0) if shared_output is not None else 0,
        gate.stride(0) if gate is not None else 0,
        TOPK=top_k, HAS_SHARED=shared_output is not None, HAS_GATE=gate is not None,
        RNE_BF16=_interpret() and out.dtype == torch.bfloat16, BLOCK_H=block_h,
        num_warps=4, **pdl_kwargs(y),
    )
    return out


def moe_reduce(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype | None = None,
               shared_output: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_reduce_ref``'s contract: Triton where ``use_triton(y)``, else the twin."""
    fn = moe_reduce_triton if use_triton(y) else moe_reduce_ref
    return fn(y, topk_weights, out_dtype, shared_output, shared_gate)


def _blend_ref(out: torch.Tensor, shared_output, shared_gate) -> torch.Tensor:
    """out (fp32) + [sigmoid(gate) *] shared, in fp32."""
    if shared_output is None:
        return out
    shared = shared_output.float()
    if shared_gate is not None:
        shared = torch.sigmoid(shared_gate.float().reshape(-1, 1)) * shared
    return out + shared


# ---------------------------------------------------------------------------------------- experts


def fused_moe_fp8_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    *,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor:
    """Torch twin of the FP8 W8A8 experts: x and the intermediate quantized per 128-column group
    (fp8.py), weights dequantized per 128 x 128 block, matmuls in fp32, the intermediate and each pair's
    output rounded to x's dtype, fp32 weighted reduce. Same contract as ``fused_moe``'s FP8 case."""
    num_rows, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    xq = dequantize_fp8_per_group_ref(*quantize_fp8_per_group_ref(x))  # [R, H] fp32
    y = torch.empty(flat.numel(), down_proj.shape[1], dtype=x.dtype, device=x.device)  # [P, H]
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        h = xq[pairs // top_k] @ dequantize_fp8_block_ref(gate_up_proj[e], w13_scale[e]).t()  # [n, 2I] fp32
        a = _gate_up_act(h, activation, swiglu_limit).to(x.dtype)  # [n, I]
        aq = dequantize_fp8_per_group_ref(*quantize_fp8_per_group_ref(a))
        y[pairs] = (aq @ dequantize_fp8_block_ref(down_proj[e], w2_scale[e]).t()).to(x.dtype)
    return moe_reduce_ref(y, topk_weights, x.dtype) if reduce else y


def fused_moe_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", *, w13_scale=None,
                  w2_scale=None, pair_threshold=64, swiglu_limit=None, shared_output=None, shared_gate=None,
                  reduce=True):
    """Torch twin of ``fused_moe`` (same contract): the layer references for x-dtype weights, the FP8 twin
    otherwise, then the shared-expert blend in fp32."""
    _check_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    _check_reduce_shared(x.shape[0], x.shape[1], shared_output, shared_gate, reduce)
    if w13_scale is not None:
        out = fused_moe_fp8_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, swiglu_limit,
                                w13_scale=w13_scale, w2_scale=w2_scale, reduce=reduce)
    else:
        ref = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
        out = ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce)
    if shared_output is None:
        return out
    return _blend_ref(out.float(), shared_output, shared_gate).to(x.dtype)


def fused_moe_triton(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", *, w13_scale=None,
                     w2_scale=None, pair_threshold=64, swiglu_limit=None, shared_output=None, shared_gate=None,
                     reduce=True):
    """Triton launcher of ``fused_moe`` (same contract): the small path for P <= pair_threshold (and
    <= SMALL_MAX_PAIRS), the grouped path above; 3 launches small, 6 grouped (one more per FP8 GEMM whose
    tile has ``a_fp8``: its activation quantizer), no host sync."""
    _check_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    _check_reduce_shared(x.shape[0], x.shape[1], shared_output, shared_gate, reduce)
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
    common = dict(limit=float(swiglu_limit) if swiglu_limit is not None else 0.0,
                  HAS_LIMIT=swiglu_limit is not None, ACT=_ACT_CODE[activation], FP8_W=fp8,
                  EMULATE_FP8=_interpret(), UPCAST=_interpret() or x.dtype == torch.float32,
                  RNE_BF16=_interpret() and x.dtype == torch.bfloat16)
    gemms = (  # (a, a_row_div, w, scale, out, n, k, gated, tile)
        (x, topk_ids.shape[1], gate_up_proj, w13_scale, act, width, hidden, True, cfg.gate_up),
        (act, 1, down_proj, w2_scale, y, hidden, width, False, cfg.down),
    )
    if small:
        from sparrow.kernels._moe_jit import moe_gemv_kernel

        flat_ids = topk_ids.reshape(-1)
        p_pad = _next_pow2(pairs)
        block_r = max(16, min(p_pad, _next_pow2(rows)))  # an expert appears at most once per row
        for a, div, w, s, out, n, k, gated, tile in gemms:
            tile = _fit_shared_memory(tile, block_r, a.element_size(), w.element_size(), gated)
            n_tiles = -(-n // tile.block_n)
            split, ws, locks = split_k.plan(x.device, pairs * n_tiles, -(-k // tile.block_k), tile.split_k,
                                            (2 if gated else 1) * block_r * tile.block_n, out)
            moe_gemv_kernel[(pairs, n_tiles, split)](
                a, w, s if fp8 else w, out, flat_ids, ws, locks,
                pairs, n, k, div, a.stride(0), w.stride(0), w.stride(1),
                s.stride(0) if fp8 else 0, s.stride(1) if fp8 else 0, GATED=gated, P_PAD=p_pad,
                BLOCK_R=block_r, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                SUB_K=min(tile.block_k, GROUP) if fp8 else tile.block_k, SPLIT_K=split, SWAP_AB=tile.swap_ab,
                PREFETCH=0 if gated else prefetch_bytes(x, w),
                num_warps=tile.num_warps, num_stages=tile.num_stages, **common, **pdl_kwargs(x),
            )
    else:
        from sparrow.kernels._moe_jit import moe_gemm_kernel

        from sparrow.kernels.scaled_mm import quantize_fp8_per_group_triton

        sorted_ids, block_expert, total = moe_align_triton(topk_ids, num_experts, cfg.block_m)
        for a, div, w, s, out, n, k, gated, tile in gemms:
            a_fp8 = fp8 and tile.a_fp8
            a, a_s = quantize_fp8_per_group_triton(a) if a_fp8 else (a, a)  # e4m3 a + [rows, G] scales
            moe_gemm_kernel[(block_expert.numel(), -(-n // tile.block_n))](
                a, a_s, w, s if fp8 else w, out, sorted_ids, block_expert, total, pairs, n, k, div, a.stride(0),
                a_s.stride(0) if a_fp8 else 0, w.stride(0), w.stride(1), s.stride(0) if fp8 else 0,
                s.stride(1) if fp8 else 0, GATED=gated, BLOCK_M=cfg.block_m, BLOCK_N=tile.block_n,
                BLOCK_K=tile.block_k, SUB_K=min(tile.block_k, GROUP) if fp8 else tile.block_k,
                SWAP_AB=tile.swap_ab, A_FP8=a_fp8,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **common, **pdl_kwargs(x),
            )
    return moe_reduce_triton(y, topk_weights, x.dtype, shared_output, shared_gate) if reduce else y


def fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", *, w13_scale=None,
              w2_scale=None, pair_threshold=64, swiglu_limit=None, shared_output=None, shared_gate=None,
              reduce=True):
    """Routed experts (+ shared-expert blend) of x [R, H] -> [R, H] in x's dtype; see the module doc.
    ``reduce=False`` (no shared expert): the unweighted per-pair outputs [P, H] in pair order instead, for a
    consumer that fuses the weighted reduce (``moe_reduce``'s y). Triton where ``use_triton(x)``, else
    ``fused_moe_ref``. Raises ValueError on bad shapes / dtypes."""
    fn = fused_moe_triton if use_triton(x) else fused_moe_ref
    return fn(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, w13_scale=w13_scale,
              w2_scale=w2_scale, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit,
              shared_output=shared_output, shared_gate=shared_gate, reduce=reduce)


# ---------------------------------------------------------------------------------------- checks


def _check_moe(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_moe: x must be [R, H] fp32 / bf16 / fp16, got {tuple(x.shape)} {x.dtype}")
    rows, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"fused_moe: gate_up_proj must be [E, 2I, H={hidden}], got {tuple(w13.shape)}")
    num_experts, width = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, width):
        raise ValueError(f"fused_moe: down_proj must be [E={num_experts}, H={hidden}, I={width}], got "
                         f"{tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != rows or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be [R={rows}, K] int32 / int64, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe: topk_weights must be a float [R, K] = {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if activation not in _ACT_CODE:
        raise ValueError(f"fused_moe: unsupported activation {activation!r}; expected one of {sorted(_ACT_CODE)}")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_moe: FP8 needs both w13_scale and w2_scale")
    if w13_scale is None:
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"fused_moe: weights dtype {w13.dtype} / {w2.dtype} != x dtype {x.dtype} (FP8 "
                             f"weights need w13_scale / w2_scale)")
    else:
        for name, w, s in (("gate_up_proj", w13, w13_scale), ("down_proj", w2, w2_scale)):
            want = (num_experts, -(-w.shape[1] // GROUP), -(-w.shape[2] // GROUP))
            if w.dtype != FP8_DTYPE:
                raise ValueError(f"fused_moe: FP8 {name} must be float8_e4m3fn, got {w.dtype}")
            if tuple(s.shape) != want or s.dtype != torch.float32 or s.stride(2) != 1:
                raise ValueError(f"fused_moe: {name} scale must be fp32 {want} with unit last stride, got "
                                 f"{tuple(s.shape)} {s.dtype}")
    for name, t in (("gate_up_proj", w13), ("down_proj", w2)):
        if t.stride(2) != 1:
            raise ValueError(f"fused_moe: {name} needs unit stride on its last dim, got {t.stride()}")
    for name, t in (("gate_up_proj", w13), ("down_proj", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t is not None and t.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {t.device}, x on {x.device}")


def _check_reduce_shared(rows, hidden, shared_output, shared_gate, reduce=True) -> None:
    if not reduce and shared_output is not None:
        raise ValueError("fused_moe: reduce=False returns the per-pair outputs; blend shared_output after the reduce")
    if shared_output is not None and (tuple(shared_output.shape) != (rows, hidden) or shared_output.stride(1) != 1):
        raise ValueError(f"moe_reduce: shared_output must be [R={rows}, H={hidden}] with unit stride on H, got "
                         f"{tuple(shared_output.shape)}")
    if shared_gate is not None:
        if shared_output is None:
            raise ValueError("moe_reduce: shared_gate needs shared_output")
        if shared_gate.numel() != rows or shared_gate.dim() not in (1, 2):
            raise ValueError(f"moe_reduce: shared_gate must be [R={rows}] or [R, 1], got {tuple(shared_gate.shape)}")


def _check_reduce(y, topk_weights, shared_output, shared_gate) -> tuple[int, int]:
    if topk_weights.dim() != 2 or y.dim() != 2 or y.shape[0] != topk_weights.numel():
        raise ValueError(f"moe_reduce: need y [P, H] and topk_weights [R, K] with P = R * K, got "
                         f"{tuple(y.shape)} and {tuple(topk_weights.shape)}")
    rows, top_k = topk_weights.shape
    _check_reduce_shared(rows, y.shape[1], shared_output, shared_gate)
    return rows, top_k


def _check_align(topk_ids, num_experts, block_m) -> None:
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be int32 / int64, got {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: need num_experts >= 1 and a power-of-two block_m, got {num_experts}, {block_m}")


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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


__all__ = [
    "align_sizes", "fused_moe", "fused_moe_fp8_ref", "fused_moe_ref", "fused_moe_triton",
    "moe_align", "moe_align_ref", "moe_align_triton", "moe_reduce", "moe_reduce_ref", "moe_reduce_triton",
]
