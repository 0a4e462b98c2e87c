"""LM head: hidden [S, H] -> logits [S, V] in fp32, with Gemma's optional final soft-cap
(logits = cap * tanh(logits / cap)). The product is the model's LM head method (``CausalLM.lm_head_method``):
``TableLMHeadMethod`` (the LM table's own weight method: ``F.linear`` on a float table, the GGUF kernel on a
GGUF file's blocks; tied, the embedding's table) unless ``quantize_lm_head`` gave the model a
``QuantizedLMHeadMethod`` on a format's linear method (``QuantizationConfig.get_lm_head_linear_method``).
Vocab-parallel: the LM table (tied: the embedding's) is this rank's [V', H] rows (``sparrow.layers.embedding``), a
method computes [S, V'] and ``gather_logits`` concatenates the ranks' logits into [S, V], the same on every rank."""
from __future__ import annotations

import torch
from torch import nn

from sparrow.layers.linear import Linear
from sparrow.quant.base import LinearMethodBase


class LMHeadMethodBase:
    """How a ``CausalLM`` turns hidden [S, H] into logits [S, V] (fp32 or the compute dtype; the logits
    processor casts to fp32). Methods take the model: the LM weight may be the tied embedding."""

    def create_weights(self, model: nn.Module, dtype: torch.dtype) -> None:
        pass

    def process_weights_after_loading(self, model: nn.Module) -> None:
        pass

    def apply(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TableLMHeadMethod(LMHeadMethodBase):
    """logits [S, V] = hidden [S, H] @ table [V, H].T in the model dtype, computed by the weight method of the
    vocab table ``model.lm_table`` (``VocabEmbedding.logits``): one copy of the table when tied."""

    def apply(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_table.logits(hidden)


class QuantizedLMHeadMethod(LMHeadMethodBase):
    """The logits from a copy of the loaded LM weight [V, H] in the format of ``linear_method`` (a Linear
    ``model.lm_head_quantized`` made after loading). A tied weight stays (it is the embedding), so there the
    copy adds its bytes; an untied ``lm_head`` is dropped (``model.lm_weight`` then raises AttributeError)."""

    def __init__(self, linear_method: LinearMethodBase):
        self.linear_method = linear_method

    def process_weights_after_loading(self, model: nn.Module) -> None:
        w = model.lm_weight
        with torch.device(w.device):
            head = Linear(w.shape[1], w.shape[0], dtype=w.dtype, quant_method=self.linear_method)
        head.weight.weight_loader(head.weight, w.data, None, "lm_head.weight")
        head.quant_method.process_weights_after_loading(head)
        model.lm_head_quantized = head.eval()
        if not model.config.tie_word_embeddings:
            del model.lm_head

    def apply(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_head_quantized(hidden)


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's logits [S, V'] -> [S, V]: the ranks' concatenated in rank order, the padding past V dropped; with
    one rank ``logits`` itself."""
    from sparrow.distributed import get_tp

    tp = get_tp()
    if tp.world_size == 1:
        return logits
    return tp.all_gather(logits, dim=-1)[..., :vocab_size]


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
