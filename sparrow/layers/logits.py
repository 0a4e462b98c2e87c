"""LM head: hidden [S, H] -> logits [S, V] in fp32, with Gemma's optional final soft-cap
(logits = cap * tanh(logits / cap)). The product is the model's LM head method (``CausalLM.lm_head_method``):
``UnquantizedLMHeadMethod`` (``F.linear`` on the model-dtype LM weight, tied or not) unless
``quantize_lm_head`` gave the model a format's method (``sparrow.quant``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.quant.base import LMHeadMethodBase


class UnquantizedLMHeadMethod(LMHeadMethodBase):
    """logits [S, V] = hidden [S, H] @ ``model.lm_weight`` [V, H].T in the model dtype."""

    def apply(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, model.lm_weight)


class LogitsProcessor(nn.Module):
    """forward(logits [S, V], any float dtype) -> fp32 [S, V], soft-capped when ``soft_cap`` is set."""

    def __init__(self, soft_cap: float | None = None):
        super().__init__()
        self.soft_cap = soft_cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.soft_cap is not None:
            logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
        return logits
