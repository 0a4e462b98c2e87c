"""Token embedding, optionally scaled (Gemma: x sqrt(H), the scale cast to the table dtype as HF does),
with soft-token injection: rows marked as soft take caller-supplied vectors instead of a table row."""
from __future__ import annotations

import torch
from torch import nn


class VocabEmbedding(nn.Module):
    """weight [V, H]; forward(input_ids [R]) -> [R, H] in the weight dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor, soft_embeds: torch.Tensor | None = None,
                soft_mask: torch.Tensor | None = None) -> torch.Tensor:
        """soft_embeds [n_soft, H] replace the rows where soft_mask [R] (bool) is True, unscaled
        (as transformers' ``inputs_embeds`` path: the caller's vectors go in as given)."""
        x = self.weight[input_ids.clamp(min=0)]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if soft_embeds is not None:
            x = x.clone()
            x[soft_mask] = soft_embeds.to(x.dtype)
        return x
