"""RMSNorm with HF's numerics (Zhang & Sennrich 2019, arXiv:1910.07467).

Llama convention (LlamaRMSNorm): normalize in fp32, cast back, then multiply by w.
Gemma convention (Gemma3RMSNorm): normalize in fp32, multiply by (1 + w) in fp32, cast back.
``with_scale=False`` is the scale-free norm (Gemma 4 v_norm and router norm).
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, gemma: bool = False
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w over the last dim; x [..., H], weight [H] or None. Returns x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(x.dtype)
    if gemma:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (size H); ``forward(x, residual=None)``.

    With ``residual`` given it returns ``(norm(x + residual), x + residual)``, the pre-norm pattern of
    every decoder layer (the sum is done in x's dtype, as HF does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, gemma: bool = False, with_scale: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        init = torch.zeros if gemma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            return rms_norm_torch(x, self.weight, self.eps, self.gemma), x
        return rms_norm_torch(x, self.weight, self.eps, self.gemma)
