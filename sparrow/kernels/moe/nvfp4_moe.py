"""NVFP4 routed experts (W4A16 on Hopper): the torch twin and the dispatcher.

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width (H and I multiples of 16), P = R * K.

    nvfp4_fused_moe(x [R, H], w13 uint8 [E, 2I, H/2], w13_scale e4m3 [E, 2I, H/16], w13_global fp32 [E, 2, 1],
                    w2 uint8 [E, H, I/2], w2_scale e4m3 [E, H, I/16], w2_global fp32 [E, 1, 1], topk_weights [R, K],
                    topk_ids [R, K], activation="silu", *, divide_global=False, pair_threshold=64,
                    swiglu_limit=None, reduce=True) -> [R, H] in x's dtype (reduce=False: the per-pair outputs [P, H])

Weights as ``sparrow.kernels.gemm.nvfp4`` packs them (two e2m1 codes a byte, an e4m3 scale per 16 columns); the
global scales are the gate's and the up projection's (``w13_global[e, 0 / 1]``) and the down projection's, as
ModelOpt's ``weight_scale_2`` (w = e2m1 * scale * global) or, with ``divide_global``, compressed-tensors'
``weight_global_scale`` (w = e2m1 * scale / global). The twin ``nvfp4_fused_moe_ref`` dequantizes the selected
experts (``dequantize_nvfp4_ref``, fp32) to x's dtype and runs the float twins of ``moe_ref``; the Triton path
(``nvfp4_fused_moe_triton``) is ``int4_moe.w4_fused_moe_triton`` with the codes read as int32 words, each
e2m1 value times its e4m3 scale in the kernel (exact in bf16) and the global scale applied to the fp32 sums.
"""
from __future__ import annotations

import torch

from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref
from sparrow.kernels.gemm.nvfp4 import GROUP, SCALE_DTYPE, dequantize_nvfp4_ref


def dequantize_nvfp4_experts(codes: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor, divide_global: bool,
                             experts: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked experts (codes [E, N, K/2], scale [E, N, K/16], glob [E, B, 1]: B row blocks of equal height with
    one global scale each) -> fp32 [E, N, K]; only the experts in ``experts`` when given (the others zero)."""
    e, rows = codes.shape[:2]
    per_row = glob.reshape(e, -1).float().repeat_interleave(rows // glob.shape[1], dim=1)  # [E, N]
    if experts is None:
        return dequantize_nvfp4_ref(codes, scale, per_row, divide_global)
    out = torch.zeros(e, rows, codes.shape[2] * 2, dtype=torch.float32, device=codes.device)
    out[experts] = dequantize_nvfp4_ref(codes[experts], scale[experts], per_row[experts], divide_global)
    return out


def nvfp4_fused_moe_ref(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids,
                        activation="silu", *, divide_global=False, pair_threshold=64, swiglu_limit=None, reduce=True,
                        lora=None):
    """The torch twin of ``nvfp4_fused_moe`` (module doc)."""
    _check(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    used = torch.unique(topk_ids.reshape(-1))
    gate_up = dequantize_nvfp4_experts(w13, w13_scale, w13_global, divide_global, used).to(x.dtype)
    down = dequantize_nvfp4_experts(w2, w2_scale, w2_global, divide_global, used).to(x.dtype)
    path = fused_moe_grouped_ref if topk_ids.numel() > pair_threshold else fused_moe_per_pair_ref
    return path(x, gate_up, down, topk_weights, topk_ids, activation, swiglu_limit, reduce=reduce, lora=lora)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K/2] viewed as int32 words [..., K/8] (K % 16 == 0)."""
    return codes.contiguous().view(torch.int32)


def nvfp4_fused_moe_triton(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids,
                           activation="silu", *, divide_global=False, pair_threshold=64, swiglu_limit=None,
                           reduce=True):
    """Triton launcher of ``nvfp4_fused_moe`` (same contract; weights contiguous): ``int4_moe.w4_fused_moe_triton``
    on the codes viewed as int32 words [E, N, K/8]."""
    from sparrow.kernels.moe.int4_moe import w4_fused_moe_triton

    _check(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    e = w13.shape[0]
    return w4_fused_moe_triton(
        x, _words(w13), w13_scale.contiguous(), None, w13_global.reshape(e, 2).float().contiguous(), _words(w2),
        w2_scale.contiguous(), None, w2_global.reshape(e, 1).float().contiguous(), GROUP, topk_weights, topk_ids,
        activation, pair_threshold=pair_threshold, swiglu_limit=swiglu_limit, reduce=reduce,
        divide_global=divide_global)


def nvfp4_fused_moe(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids,
                    activation="silu", *, divide_global=False, pair_threshold=64, swiglu_limit=None, reduce=True,
                    lora=None):
    """Routed NVFP4 experts; see the module doc. Triton (``nvfp4_fused_moe_triton``) where ``use_triton(x)``, else
    the twin. ``lora``: per-pair adapter deltas (``moe.fused_moe``'s); on Triton they take every expert
    dequantized to x's dtype (``int4_moe.dequantized_experts``) and the float kernels. Raises ValueError on bad shapes or dtypes."""
    from sparrow.kernels import use_triton

    if lora is not None and use_triton(x):
        from sparrow.kernels.moe.moe import fused_moe

        from sparrow.kernels.moe.int4_moe import dequantized_experts

        _check(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global)
        e = w13.shape[0]
        gate_up, down = dequantized_experts(
            _words(w13), w13_scale.contiguous(), None, w13_global.reshape(e, 2).float().contiguous(), _words(w2),
            w2_scale.contiguous(), None, w2_global.reshape(e, 1).float().contiguous(), GROUP, x.dtype, divide_global)
        return fused_moe(x, gate_up, down, topk_weights, topk_ids, activation, pair_threshold=pair_threshold,
                         swiglu_limit=swiglu_limit, reduce=reduce, lora=lora)
    if use_triton(x):
        return nvfp4_fused_moe_triton(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights,
                                      topk_ids, activation, divide_global=divide_global,
                                      pair_threshold=pair_threshold, swiglu_limit=swiglu_limit, reduce=reduce)
    return nvfp4_fused_moe_ref(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids,
                               activation, divide_global=divide_global, pair_threshold=pair_threshold,
                               swiglu_limit=swiglu_limit, reduce=reduce, lora=lora)


def _check(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"nvfp4_fused_moe: need x [R, H], w13 [E, 2I, H/2], w2 [E, H, I/2], got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, half_h = w13.shape
    h, i = x.shape[1], two_i // 2
    if half_h * 2 != h or h % GROUP or i % GROUP or tuple(w2.shape) != (e, h, i // 2):
        raise ValueError(f"nvfp4_fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not "
                         f"fit (hidden and expert width multiples of {GROUP})")
    for name, t, want in (("w13_scale", w13_scale, (e, two_i, h // GROUP)), ("w2_scale", w2_scale, (e, h, i // GROUP))):
        if t.dtype != SCALE_DTYPE or tuple(t.shape) != want:
            raise ValueError(f"nvfp4_fused_moe: {name} must be e4m3 {want}, got {t.dtype} {tuple(t.shape)}")
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"nvfp4_fused_moe: codes must be uint8, got {w13.dtype} and {w2.dtype}")
    if w13_global.numel() != 2 * e or w2_global.numel() != e:
        raise ValueError(f"nvfp4_fused_moe: global scales must be [E, 2, 1] and [E, 1, 1], got "
                         f"{tuple(w13_global.shape)} and {tuple(w2_global.shape)}")
