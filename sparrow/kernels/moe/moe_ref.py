"""Torch twins of the fused MoE experts (``sparrow.kernels.moe.moe.fused_moe``): the CPU path and the oracle.

Shapes: R = rows, H = hidden, E = experts, K = top-k (experts per row), I = expert width,
P = R * K (row, expert) pairs (pair p = row p // K, slot p % K).

Two float paths with one signature, chosen by P vs ``pair_threshold`` as the kernels are:
- grouped (P > threshold, prefill): stable-sort the pairs by expert, per-expert offsets, one matmul per
  expert over its contiguous slice (each expert's weights read once), activation, down matmul, then an
  unpermute with a weighted reduce (index_add) back to row order;
- per-pair (P <= threshold, decode / speculative verify): gather each pair's expert weights, batched
  GEMVs, weighted sum over K; no sort.
Matmuls run in x's dtype and the activation rounds as transformers' experts do (``sparrow.kernels.activation.act``);
the weighted reduce accumulates in fp32; the result is cast back to x's dtype. FP8 W8A8 weights:
``fused_moe_fp8_ref`` (x and the intermediate quantized per 128-column group, weights dequantized per
128 x 128 block, fp32 matmuls). ``fused_moe_ref`` dispatches among them with ``fused_moe``'s contract.
"""
from __future__ import annotations

import torch

from sparrow.kernels.activation.act import ACTIVATIONS, get_activation
from sparrow.kernels.gemm.fp8 import FP8_DTYPE, GROUP, dequantize_fp8_block_ref, dequantize_fp8_per_group_ref, \
    quantize_fp8_per_group_ref
from sparrow.kernels.moe.moe_reduce import moe_reduce_ref

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gate_up_act(h: torch.Tensor, activation: str, swiglu_limit: float | None) -> torch.Tensor:
    """act(gate) * up of h [P, 2I] -> [P, I]; DeepSeek-V4 clamps gate <= limit and |up| <= limit first."""
    if swiglu_limit is not None:
        gate, up = h.chunk(2, dim=-1)
        h = torch.cat([gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)], dim=-1)
    return get_activation(activation)(h)


def fused_moe_grouped_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    reduce: bool = True,
    lora=None,
) -> torch.Tensor:
    """Sorted / grouped expert path. x [R, H], gate_up_proj [E, 2I, H], down_proj [E, H, I],
    topk_weights [R, K] (any float dtype), topk_ids [R, K] int (each in [0, E)) -> [R, H] in x's dtype.
    ``reduce=False``: the per-pair outputs [R K, H] in pair order (pair p = row p // K, slot p % K), x's
    dtype, unweighted (the caller reduces them, as ``moe_reduce``). ``lora``: the step's per-pair adapter deltas
    (``sparrow.layers.lora_buffers.ExpertDelta``): gate_up's added before the activation, down's before the reduce."""
    num_rows, top_k = topk_ids.shape
    num_experts = gate_up_proj.shape[0]
    flat_ids = topk_ids.reshape(-1).long()  # [P], pair p = row p // K, slot p % K
    order = torch.argsort(flat_ids, stable=True)  # pairs sorted by expert
    rows = order // top_k  # [P] row of each sorted pair
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    offsets = [0, *torch.cumsum(counts, 0).tolist()]  # expert e owns sorted pairs offsets[e]:offsets[e+1]
    xs = x[rows]  # [P, H]
    h = xs.new_empty(xs.shape[0], gate_up_proj.shape[1])  # [P, 2I]
    active = [e for e in range(num_experts) if offsets[e + 1] > offsets[e]]
    for e in active:
        s, t = offsets[e], offsets[e + 1]
        h[s:t] = xs[s:t] @ gate_up_proj[e].t()
    if lora is not None:
        h = (h.float() + lora.gate_up(x)[order]).to(h.dtype)
    a = gate_up_act(h, activation, swiglu_limit)  # [P, I]
    y = xs.new_empty(xs.shape[0], down_proj.shape[1])  # [P, H]
    for e in active:
        s, t = offsets[e], offsets[e + 1]
        y[s:t] = a[s:t] @ down_proj[e].t()
    if lora is not None:
        y = lora.down(a, y, order)
    if not reduce:
        pairs = torch.empty_like(y)
        pairs[order] = y
        return pairs
    w = topk_weights.reshape(-1)[order].float()  # [P]
    out = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y.float() * w[:, None])
    return out.to(x.dtype)


def fused_moe_per_pair_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", swiglu_limit=None,
                           reduce=True, lora=None) -> torch.Tensor:
    """Per-pair GEMV path, no sort: same signature (parameter types) and result as ``fused_moe_grouped_ref``."""
    num_rows, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()  # [P]
    xp = x.repeat_interleave(top_k, dim=0)  # [P, H]
    h = torch.bmm(gate_up_proj[flat_ids], xp.unsqueeze(-1)).squeeze(-1)  # [P, 2I, H] @ [P, H, 1] -> [P, 2I]
    if lora is not None:
        h = (h.float() + lora.gate_up(x)).to(h.dtype)
    a = gate_up_act(h, activation, swiglu_limit)  # [P, I]
    y = torch.bmm(down_proj[flat_ids], a.unsqueeze(-1)).squeeze(-1)  # [P, H]
    if lora is not None:
        y = lora.down(a, y.contiguous())
    if not reduce:
        return y
    out = (y.float().view(num_rows, top_k, -1) * topk_weights.float().unsqueeze(-1)).sum(dim=1)  # [R, H]
    return out.to(x.dtype)


def fused_moe_fp8_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", swiglu_limit=None, *,
                      w13_scale: torch.Tensor, w2_scale: torch.Tensor, reduce: bool = True, lora=None) -> torch.Tensor:
    """Torch twin of the FP8 W8A8 experts (the leading parameters: ``fused_moe_grouped_ref``'s): x and the intermediate quantized per 128-column group
    (fp8.py), weights dequantized per 128 x 128 block, matmuls in fp32, the intermediate and each pair's
    output rounded to x's dtype, fp32 weighted reduce. Same contract as ``fused_moe``'s FP8 case."""
    num_rows, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    xq = dequantize_fp8_per_group_ref(*quantize_fp8_per_group_ref(x))  # [R, H] fp32
    y = torch.empty(flat.numel(), down_proj.shape[1], dtype=x.dtype, device=x.device)  # [P, H]
    acts = torch.empty(flat.numel(), down_proj.shape[2], dtype=x.dtype, device=x.device)  # [P, I]
    h_delta = lora.gate_up(x) if lora is not None else None  # [P, 2I] fp32
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        h = xq[pairs // top_k] @ dequantize_fp8_block_ref(gate_up_proj[e], w13_scale[e]).t()  # [n, 2I] fp32
        if h_delta is not None:
            h = h + h_delta[pairs]
        a = gate_up_act(h, activation, swiglu_limit).to(x.dtype)  # [n, I]
        acts[pairs] = a
        aq = dequantize_fp8_per_group_ref(*quantize_fp8_per_group_ref(a))
        y[pairs] = (aq @ dequantize_fp8_block_ref(down_proj[e], w2_scale[e]).t()).to(x.dtype)
    if lora is not None:
        y = lora.down(acts, y)
    return moe_reduce_ref(y, topk_weights, x.dtype) if reduce else y


def fused_moe_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", *, w13_scale=None,
                  w2_scale=None, pair_threshold=64, swiglu_limit=None, reduce=True, lora=None):
    """Torch twin of ``fused_moe`` (same contract): the grouped / per-pair twins for x-dtype weights (by P vs
    ``pair_threshold``), the FP8 twin otherwise."""
    _check_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    if w13_scale is not None:
        return fused_moe_fp8_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, swiglu_limit,
                                 w13_scale=w13_scale, w2_scale=w2_scale, reduce=reduce, lora=lora)
    ref = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
    return ref(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce,
               lora=lora)


def check_routing(op: str, rows: int, topk_weights, topk_ids, activation: str) -> None:
    """Raise ValueError (naming ``op``) unless topk_ids is [rows, K] int32 / int64, topk_weights a float tensor of
    its shape and ``activation`` a known name."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != rows or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: topk_ids must be [R={rows}, K] int32 / int64, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"{op}: topk_weights must be a float [R, K] = {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unsupported activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")


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
    check_routing("fused_moe", rows, topk_weights, topk_ids, activation)
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
