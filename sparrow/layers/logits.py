"""LM head: hidden [S, H] -> logits [S, V] in fp32, with Gemma's optional final soft-cap
(logits = cap * tanh(logits / cap))."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LogitsProcessor(nn.Module):
    def __init__(self, soft_cap: float | None = None):
        super().__init__()
        self.soft_cap = soft_cap

    def forward(self, hidden: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, lm_weight).float()
        if self.soft_cap is not None:
            logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
        return logits
