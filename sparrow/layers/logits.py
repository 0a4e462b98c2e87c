"""LM head: hidden [S, H] -> logits [S, V] in fp32, with Gemma's optional final soft-cap
(logits = cap * tanh(logits / cap)). The product is ``F.linear`` on the model-dtype LM weight, or a Linear
(``head``; the block-scaled FP8 copy of ``CausalLM.quantize_lm_head``) when one is given."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LogitsProcessor(nn.Module):
    def __init__(self, soft_cap: float | None = None):
        super().__init__()
        self.soft_cap = soft_cap

    def forward(self, hidden: torch.Tensor, lm_weight: torch.Tensor | None,
                head: nn.Module | None = None) -> torch.Tensor:
        logits = (F.linear(hidden, lm_weight) if head is None else head(hidden)).float()
        if self.soft_cap is not None:
            logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
        return logits
