"""RMSNorm with HF's numerics (Zhang & Sennrich 2019, arXiv:1910.07467).

Three weight conventions (``kind``), all normalizing in fp32:
- 'llama' (LlamaRMSNorm, Qwen, Mixtral, MiniMax): cast the normed x back, then multiply by w;
- 'gemma' (Gemma3RMSNorm): multiply by (1 + w) in fp32, cast back;
- 'gemma4' (Gemma4RMSNorm): x * (mean(x^2) + eps)^-0.5 (torch.pow, as HF), multiply by w in fp32, cast back.
``with_scale=False`` is the scale-free norm (Gemma 4 v_norm and router norm). The arithmetic is
``sparrow.kernels.norm_rope.norm``'s: its Triton kernel where ``use_triton(x)``, its torch twin ``rms_norm_ref`` otherwise.
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.kernels import use_triton
from sparrow.kernels.norm_rope.norm import rms_norm_ref, rms_norm_triton

NORM_KINDS = ("llama", "gemma", "gemma4")


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (size H); ``forward(x, residual=None)``.

    With ``residual`` given it returns ``(norm(x + residual), x + residual)``, the pre-norm pattern of
    every decoder layer (the sum is done in x's dtype, as HF does). ``kind`` picks the weight convention
    (module docstring); ``gemma=True`` is shorthand for kind='gemma'."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, gemma: bool = False, with_scale: bool = True,
                 dtype: torch.dtype = torch.float32, kind: str | None = None):
        super().__init__()
        kind = kind or ("gemma" if gemma else "llama")
        if kind not in NORM_KINDS:
            raise ValueError(f"unknown RMSNorm kind {kind!r}; expected one of {NORM_KINDS}")
        self.eps = eps
        self.kind = kind
        self.gemma = kind == "gemma"
        init = torch.zeros if kind == "gemma" else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_triton(x) and (residual is None or x.dim() == 2):
            return rms_norm_triton(x, self.weight, self.eps, residual=residual, **self._convention())
        # the twin on [N, H] rows: any leading shape, any strides
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        res = residual.reshape(-1, shape[-1]) if residual is not None else None
        out = rms_norm_ref(rows if rows.stride(-1) == 1 else rows.contiguous(), self.weight, self.eps,
                           residual=res if res is None or res.is_contiguous() else res.contiguous(),
                           **self._convention())
        if residual is not None:
            return out[0].view(shape), out[1].view(shape)
        return out.view(shape)

    def _convention(self) -> dict:
        """The kernel's weight-convention flags for this norm's kind (sparrow.kernels.norm_rope.norm)."""
        return {"gemma": self.kind != "llama", "unit_offset": self.kind == "gemma"}

    def norm_add(self, x: torch.Tensor, add: torch.Tensor, scale: torch.Tensor | None = None,
                 pre: tuple[RMSNorm, torch.Tensor] | None = None, pre_add_norm: RMSNorm | None = None,
                 next_norms: tuple[RMSNorm, ...] = (), pair_weights: torch.Tensor | None = None):
        """``(add + norm(x)) * scale`` for x, add [R, H] and scale [1] or None: the post-norm residual add of
        Gemma-style sandwich norms (and Gemma 4's layer_scalar), each step rounded to x's dtype as
        transformers computes it. ``pre = (norm2, add2)``: x is first ``norm2.norm_add(x, add2)``, and with
        ``pre_add_norm`` add2 is first ``pre_add_norm(add2)`` (Gemma 4's two branch post-norms before their sum).
        ``next_norms`` (at most 2): the norms of the result that the next ops read (the next sandwich's
        pre-norms), returned after it: ``(y, *[n(y) for n in next_norms])``. ``pair_weights`` [R, K]: x is the
        experts' unweighted per-pair outputs [R K, H] (``FusedMoE(..., reduce=False)``), weighted and summed first.

        On the Triton path all of it is one kernel when every norm has a weight and shares this one's kind and
        eps (sparrow.kernels.norm_rope.norm.rms_norm); otherwise the ops run one by one, with the same results."""
        first = pre[0] if pre is not None else None
        norms = [n for n in (self, first, pre_add_norm) if n is not None] + list(next_norms)
        if use_triton(x) and x.dim() == 2 and len(next_norms) <= 2 and (pre is not None or pre_add_norm is None) \
                and all(n.kind == self.kind and n.eps == self.eps and n.weight is not None for n in norms):
            return rms_norm_triton(
                x.contiguous(), self.weight, self.eps, post_add=add.contiguous(), post_scale=scale,
                pre_weight=pre[0].weight if pre is not None else None,
                pre_add=pre[1].contiguous() if pre is not None else None,
                pre_add_weight=pre_add_norm.weight if pre_add_norm is not None else None,
                next_weights=tuple(n.weight for n in next_norms), pair_weights=pair_weights, **self._convention())
        if pair_weights is not None:
            from sparrow.kernels.moe.moe_reduce import moe_reduce

            x = moe_reduce(x, pair_weights, x.dtype)
        if pre is not None:
            x = pre[0].norm_add(x, pre[1] if pre_add_norm is None else pre_add_norm(pre[1]))
        if use_triton(x) and x.dim() == 2:
            y = rms_norm_triton(x, self.weight, self.eps, post_add=add.contiguous(), post_scale=scale,
                                **self._convention())
        elif x.dim() == 2:
            y = rms_norm_ref(x.contiguous(), self.weight, self.eps, post_add=add.contiguous(), post_scale=scale,
                             **self._convention())
        else:
            y = add + self(x)
            y = y if scale is None else y * scale
        if not next_norms:
            return y
        return (y,) + tuple(n(y) for n in next_norms)


class ShardedRMSNorm(nn.Module):
    """A 'llama'-kind RMSNorm over a dimension of ``full_size`` split over the tensor-parallel ranks (MiniMax-M2's
    q/k norms over the whole [Hq D] / [Hkv D] projection): this rank holds elements [start, start + size) of x and of
    ``weight``; the sum of squares is all-reduced, so each rank's slice is that of the full norm.
    forward(x [R, size]) -> [R, size] in x's dtype; ``weight`` loads from the checkpoint's [full_size] vector."""

    def __init__(self, full_size: int, start: int, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.full_size, self.start, self.eps = full_size, start, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
        from sparrow.errors import ModelLoadError

        if tuple(loaded.shape) != (self.full_size,):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {(self.full_size,)}")
        param.data.copy_(loaded[self.start:self.start + param.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sparrow.distributed import get_tp

        xf = x.float()
        var = get_tp().all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.full_size
        return (xf * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight
