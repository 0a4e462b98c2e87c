"""RMSNorm, optionally fused with the residual add, the sandwich norms' post-add and scale, a chain of next
norms and the MoE's weighted reduce.

Shapes: R = rows, H = hidden, nH = heads, D = head dim.

    rms_norm(x [R, H] | [R, nH, D], weight [H] | [D] | None, eps, *, gemma, unit_offset, residual, ...)

``rms_norm_ref`` is the torch twin (CPU path and oracle), ``rms_norm_triton`` the launcher with the same
signature, ``rms_norm`` the dispatcher: Triton for CUDA tensors (or anywhere under ``sparrow.kernels.backend("triton")``,
as the tests do under ``TRITON_INTERPRET=1``), the twin otherwise.

Conventions (each matches its transformers module exactly when the weight has x's dtype):
- Llama (``gemma=False``, ``LlamaRMSNorm``): x̂ = x * rsqrt(mean(x²) + eps) in fp32, cast to x's dtype, then
  multiplied by the weight: ``(w * x̂.to(dtype)).to(dtype)``.
- Gemma 1-3 (``gemma=True``, ``Gemma3RMSNorm``): ``(x̂ * (1 + w.float())).to(dtype)``, all in fp32.
- Gemma 4 (``gemma=True, unit_offset=False``, ``Gemma4RMSNorm``): ``(x̂ * w.float()).to(dtype)``, with
  x̂ = x * pow(mean(x²) + eps, -0.5) as that module computes it (the Triton kernel uses rsqrt: the same
  value up to an fp32 ulp).
- ``weight=None``: scale-free, ``x̂.to(dtype)`` (Gemma 4 v_norm and router norm, ``with_scale=False``).
The output always has x's dtype (HF's Llama module would promote to an fp32 weight's dtype).
"""
from __future__ import annotations

import torch

from sparrow.kernels import dispatch, pdl_kwargs
from sparrow.kernels.common.tiles import next_pow2
from sparrow.kernels.gemm.fp8 import GROUP


MAX_HIDDEN = 65536  # one program holds a whole row in registers
# (largest tile elements, num_warps): one (row, head) per program, warps grow with the row width.
NORM_WARPS: tuple[tuple[int, int], ...] = ((256, 1), (1024, 2), (2048, 4), (8192, 8), (MAX_HIDDEN, 16))

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    gemma: bool = False,
    unit_offset: bool = True,
    residual: torch.Tensor | None = None,
    post_add: torch.Tensor | None = None,
    post_scale: torch.Tensor | None = None,
    pre_weight: torch.Tensor | None = None,
    pre_add: torch.Tensor | None = None,
    pre_add_weight: torch.Tensor | None = None,
    next_weights: tuple[torch.Tensor, ...] = (),
    pair_weights: torch.Tensor | None = None,
):
    """Torch twin of ``rms_norm``; see the module doc for the formulas and ``rms_norm`` for the returns."""
    _check(x, weight, residual, post_add, post_scale, pre_weight, pre_add, pre_add_weight, next_weights,
           pair_weights)
    dtype = x.dtype
    new_residual = None
    if pair_weights is not None:  # moe_reduce_ref: fp32 weighted sum over the K slots, rounded once
        rows, top_k = pair_weights.shape
        x = (x.float().view(rows, top_k, -1) * pair_weights.float().unsqueeze(-1)).sum(dim=1).to(dtype)
    gemma4 = gemma and not unit_offset
    if pre_add is not None:
        pre_hat = _normed(x, eps, gemma4)
        a = pre_add.float()
        if pre_add_weight is not None:
            a = _weighted(_normed(pre_add, eps, gemma4), pre_add_weight, dtype, gemma, unit_offset).float()
        x = (a + _weighted(pre_hat, pre_weight, dtype, gemma, unit_offset).float()).to(dtype)
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)  # HF adds in the model dtype
        new_residual = x
    xhat = _normed(x, eps, gemma4)
    y = xhat.to(dtype) if weight is None else _weighted(xhat, weight, dtype, gemma, unit_offset)
    if post_add is not None:
        y = (post_add.float() + y.float()).to(dtype)
    if post_scale is not None:
        y = (y.float() * post_scale.float()).to(dtype)
    outs: tuple = (y,)
    if new_residual is not None:
        outs = outs + (new_residual,)
    if next_weights:
        y_hat = _normed(y, eps, gemma4)
        outs = outs + tuple(_weighted(y_hat, w, dtype, gemma, unit_offset) for w in next_weights)
    return outs[0] if len(outs) == 1 else outs


def _normed(x: torch.Tensor, eps: float, gemma4: bool) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in fp32 over the last dim: ``torch.pow(m, -0.5)`` for Gemma 4's convention,
    as ``Gemma4RMSNorm`` computes it, ``torch.rsqrt`` for the others (Llama / Gemma 3), as theirs do."""
    xf = x.float()
    mean_sq = xf.pow(2).mean(-1, keepdim=True) + eps
    return xf * (torch.pow(mean_sq, -0.5) if gemma4 else torch.rsqrt(mean_sq))


def _weighted(xhat: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, gemma: bool, unit_offset: bool):
    """fp32 xhat times the weight, rounded to dtype by the convention (module doc)."""
    if gemma:
        w = weight.float()
        return (xhat * (1.0 + w if unit_offset else w)).to(dtype)
    return (weight.float() * xhat.to(dtype).float()).to(dtype)


def rms_norm_triton(x, weight, eps, *, gemma=False, unit_offset=True, residual=None, post_add=None, post_scale=None,
                    pre_weight=None, pre_add=None, pre_add_weight=None, next_weights=(), pair_weights=None):
    """Triton launcher of ``rms_norm`` (``rms_norm_ref``'s parameters, types and returns); one program per
    (row, head)."""
    from sparrow.kernels.norm_rope._norm_jit import rms_norm_kernel

    _check(x, weight, residual, post_add, post_scale, pre_weight, pre_add, pre_add_weight, next_weights,
           pair_weights)
    hidden = x.shape[-1]
    rows = x.shape[0] if pair_weights is None else pair_weights.shape[0]
    heads = x.shape[1] if x.dim() == 3 else 1
    out_shape = x.shape if pair_weights is None else (rows, hidden)
    stride_xh = x.stride(1) if x.dim() == 3 else 0
    group = GROUP if hidden >= GROUP else max(16, next_pow2(hidden))
    block_g = next_pow2(-(-hidden // group))
    num_warps = next(w for limit, w in NORM_WARPS if block_g * group <= limit)

    y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    nexts = tuple(torch.empty_like(y) for _ in next_weights)
    next_w = tuple(next_weights) + (x,) * (2 - len(next_weights))  # dummies past the last
    next_y = nexts + (x,) * (2 - len(nexts))
    if rows > 0:
        rms_norm_kernel[(rows, heads)](
            x,
            residual if residual is not None else x,
            weight if weight is not None else x,
            y,
            new_residual if new_residual is not None else x,
            post_add if post_add is not None else x,
            post_scale if post_scale is not None else x,
            pre_weight if pre_weight is not None else x,
            pre_add if pre_add is not None else x,
            pre_add_weight if pre_add_weight is not None else x,
            *next_w,
            *next_y,
            pair_weights if pair_weights is not None else x,
            pair_weights.stride(0) if pair_weights is not None else 0,
            hidden,
            heads,
            x.stride(0),
            stride_xh,
            float(eps),
            HAS_WEIGHT=weight is not None,
            HAS_RESIDUAL=residual is not None,
            GEMMA=bool(gemma),
            UNIT_OFFSET=bool(unit_offset),
            HAS_POST_ADD=post_add is not None,
            HAS_POST_SCALE=post_scale is not None,
            HAS_PRE=pre_add is not None,
            PRE_ADD_NORM=pre_add_weight is not None,
            NUM_NEXT=len(next_weights),
            TOPK=pair_weights.shape[1] if pair_weights is not None else 0,
            BLOCK_G=block_g,
            GROUP=group,
            num_warps=num_warps, **pdl_kwargs(x),
        )
    outs: tuple = (y,)
    if new_residual is not None:
        outs = outs + (new_residual,)
    outs = outs + nexts
    return outs[0] if len(outs) == 1 else outs


rms_norm = dispatch("rms_norm", rms_norm_triton, rms_norm_ref, """RMSNorm of x over its last dim (``rms_norm_ref``'s
    signature); Triton by ``sparrow.kernels.use_triton`` (CUDA, or forced), the torch twin otherwise.

    x: [R, H] or per-head [R, nH, D] (q_norm / k_norm; any row / head strides, unit stride on the last
    dim), fp32 / bf16 / fp16. weight: [H] (any float dtype) or None for scale-free. eps: float.
    gemma / unit_offset: the convention (module doc). residual: [R, H] of x's dtype and shape (2-D x only):
    x + residual is rounded to x's dtype, normalized, and returned as the new residual.
    post_add [R, H] of x's dtype and shape (2-D x only, not with residual): the post-norm residual
    add of Gemma-style sandwich norms, ``y = (post_add + y)`` rounded to x's dtype; post_scale [1] (with or
    without post_add): ``y = y * post_scale`` rounded (Gemma 4's layer_scalar). Both as HF computes them.
    pre_weight [H] and pre_add [R, H] (together; 2-D x, no residual): x is first replaced by
    ``pre_add + norm(x, pre_weight)`` (same eps and convention, rounded as above), so two sandwich norms
    ``(post_add + norm(pre_add + norm(x, pre_weight), weight)) * post_scale`` are one kernel (Gemma 4's
    post_feedforward_layernorm_2 then post_feedforward_layernorm). pre_add_weight [H] (with pre_add): pre_add is
    normalized too, ``norm(pre_add, pre_add_weight) + norm(x, pre_weight)`` (Gemma 4's post_feedforward_layernorm_1
    of the dense branch). next_weights: up to 2 weights [H] (2-D x): each further norm of the output,
    ``norm(y, w)`` with the same eps and convention, is returned after y (the next sandwich's pre-norms: Gemma 4's
    pre_feedforward_layernorm / _2, and the next layer's input_layernorm), so a chain of norms is one launch.
    pair_weights [R, K] (2-D x, no residual): x is [R K, H], the MoE's unweighted per-pair outputs in
    pair order, first reduced as ``moe.moe_reduce_ref`` does (fp32 sum over k of w[r, k] x[r K + k], rounded to
    x's dtype); every other tensor and each output is then [R, H] (the experts' weighted reduce fused).

    Under PDL (``sparrow.kernels.use_pdl``) the kernel reads weight, pre_weight, pre_add_weight, post_scale and
    next_weights before it waits for the kernel launched before it, so none of them may be that kernel's output
    (model parameters are fine).

    Returns ``y`` [R, H] in x's dtype, with ``new_residual`` [R, H] appended when residual is given:
    ``(y, new_residual)``; then one [R, H] tensor in x's dtype per next_weights entry.
    Raises ValueError naming the bad shape, dtype or stride.
    """)


def _check(x, weight, residual, post_add=None, post_scale=None, pre_weight=None, pre_add=None,
           pre_add_weight=None, next_weights=(), pair_weights=None) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"rms_norm: x must be [R, H] or [R, nH, D], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"rms_norm: x dtype {x.dtype} not supported (fp32, bf16, fp16)")
    hidden = x.shape[-1]
    if hidden == 0 or hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm: normalized width {hidden} outside 1..{MAX_HIDDEN}")
    if x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must have unit stride on its last dim, got strides {x.stride()}")
    if weight is not None:
        _check_vector("weight", weight, x)
    if residual is not None:
        if x.dim() != 2:
            raise ValueError("rms_norm: residual needs a 2-D x [R, H]")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
        if not residual.is_contiguous():
            raise ValueError(f"rms_norm: residual must be contiguous, got strides {residual.stride()}")
    out_shape = tuple(x.shape)
    if pair_weights is not None:
        if not isinstance(pair_weights, torch.Tensor) or pair_weights.dim() != 2 or x.dim() != 2 \
                or x.shape[0] != pair_weights.numel() or pair_weights.stride(-1) != 1 \
                or not pair_weights.is_floating_point() or pair_weights.device != x.device:
            raise ValueError(f"rms_norm: pair_weights must be a float [R, K] tensor with unit stride on K and x "
                             f"[R K, H] on its device, got {getattr(pair_weights, 'shape', pair_weights)} and x "
                             f"{tuple(x.shape)}")
        if residual is not None or not x.is_contiguous():
            raise ValueError("rms_norm: pair_weights need a contiguous x and no residual")
        out_shape = (pair_weights.shape[0], hidden)
    if post_add is not None:
        _check_addend("post_add", post_add, x, residual, out_shape)
    if post_scale is not None:
        if x.dim() != 2 or post_scale.numel() != 1 or not post_scale.is_floating_point():
            raise ValueError("rms_norm: post_scale must be a one-element float tensor, with a 2-D x")
        if post_scale.device != x.device:
            raise ValueError(f"rms_norm: post_scale on {post_scale.device}, x on {x.device}")
    if (pre_weight is None) != (pre_add is None):
        raise ValueError("rms_norm: pre_weight and pre_add go together")
    if pre_add is not None:
        _check_addend("pre_add", pre_add, x, residual, out_shape)
        _check_vector("pre_weight", pre_weight, x)
        if not x.is_contiguous():
            raise ValueError(f"rms_norm: pre_add needs a contiguous x, got strides {x.stride()}")
    if pre_add_weight is not None:
        if pre_add is None:
            raise ValueError("rms_norm: pre_add_weight needs pre_add")
        _check_vector("pre_add_weight", pre_add_weight, x)
    if len(next_weights) > 2:
        raise ValueError(f"rms_norm: at most 2 next_weights, got {len(next_weights)}")
    if next_weights and x.dim() != 2:
        raise ValueError("rms_norm: next_weights need a 2-D x [R, H]")
    for w in next_weights:
        _check_vector("next_weights entry", w, x)


def _check_vector(name: str, w: torch.Tensor, x: torch.Tensor) -> None:
    """A per-column weight: contiguous float [H] on x's device."""
    if not isinstance(w, torch.Tensor) or w.shape != x.shape[-1:] or not w.is_contiguous() \
            or w.dtype not in _FLOAT_DTYPES or w.device != x.device:
        raise ValueError(f"rms_norm: {name} must be a contiguous fp32/bf16/fp16 [{x.shape[-1]}] tensor on "
                         f"{x.device}, got {getattr(w, 'shape', w)} {getattr(w, 'dtype', '')} on "
                         f"{getattr(w, 'device', '')}")


def _check_addend(name: str, t: torch.Tensor, x: torch.Tensor, residual, shape: tuple) -> None:
    """post_add / pre_add: a contiguous tensor of the output's shape and x's dtype (2-D x, no residual)."""
    if x.dim() != 2 or residual is not None:
        raise ValueError(f"rms_norm: {name} needs a 2-D x [R, H] and no residual")
    if tuple(t.shape) != tuple(shape) or t.dtype != x.dtype or not t.is_contiguous():
        raise ValueError(f"rms_norm: {name} {tuple(t.shape)} {t.dtype} must be a contiguous "
                         f"{tuple(shape)} tensor of x's dtype {x.dtype}")
