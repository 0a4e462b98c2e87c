"""A vocab table [V, H] whose weight format is a quantization method object (``sparrow.quant.base.
EmbeddingMethodBase``): the token embedding (optionally scaled: Gemma x sqrt(H), the scale cast to the row dtype as
HF does, with soft-token injection: rows marked as soft take caller-supplied vectors instead of a table row) and
an untied LM head, whose logits are ``logits(hidden)``. The method comes from the enclosing
``quant_config_scope`` (``get_embedding_method``; a float table outside any), as a ``Linear``'s does.
Shapes: R = rows, S = rows whose logits are computed, V = vocab (``num_embeddings``), H = hidden (``embedding_dim``).

Vocab-parallel (tensor_parallel_size T > 1, vLLM's VocabParallelEmbedding): rank r holds table rows
``vocab_range`` = [r V', (r + 1) V') with V' = ceil(V / T) (rows past V are zeros), looks up the ids in its range
(the others give zero rows) and one all-reduce sums the ranks' rows. An untied LM head is split the same way; its
[S, V'] logits are gathered by ``sparrow.layers.logits.gather_logits``.
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.distributed import get_tp
from sparrow.quant.base import EmbeddingMethodBase, set_layer_method
from sparrow.quant.scope import current_quant_config


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """(first row, rows held) of this rank's share of a [V, H] table: V' = ceil(V / T) rows from r V'."""
    tp = get_tp()
    rows = -(-vocab_size // tp.world_size)
    return tp.rank * rows, rows


class VocabEmbedding(nn.Module):
    """forward(input_ids [R] int64) -> [R, H] in the model dtype ``dtype``; logits(hidden [S, H]) -> [S, V']
    (V' = V on one rank; module doc)."""

    quant_kind = "embedding"

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None,
                 dtype: torch.dtype = torch.float32, quant_method: EmbeddingMethodBase | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.params_dtype = vocab_size, hidden_size, dtype
        self.vocab_range = vocab_range(vocab_size)
        self.scale = scale
        self.prefix = ""
        self.set_quant_method(quant_method or current_quant_config().get_embedding_method(None))

    def set_quant_method(self, method: EmbeddingMethodBase) -> None:
        """(Re)create the table's parameters with ``method`` on the device of the previous ones (dropped)."""
        set_layer_method(self, method)

    def forward(self, input_ids: torch.Tensor, soft_embeds: torch.Tensor | None = None,
                soft_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Negative ids read row 0 (padding rows); an id >= V fails as indexing does (IndexError on CPU).
        soft_embeds [n_soft, H] replace the rows where soft_mask [R] (bool) is True, unscaled
        (as transformers' ``inputs_embeds`` path: the caller's vectors go in as given)."""
        start, rows = self.vocab_range
        if rows == self.num_embeddings:
            x = self.quant_method.embedding(self, input_ids.clamp(min=0))
        else:
            local = input_ids - start
            mine = (local >= 0) & (local < rows)
            x = self.quant_method.embedding(self, torch.where(mine, local, 0))
            x = get_tp().all_reduce(x * mine.unsqueeze(-1).to(x.dtype))
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if soft_embeds is not None:
            x = x.clone()
            x[soft_mask] = soft_embeds.to(x.dtype)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] @ table.T -> [S, V'] in hidden's dtype (the LM head on this rank's rows of the table)."""
        return self.quant_method.apply(self, hidden)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, hidden={self.embedding_dim}, scale={self.scale}, "
                f"quant_method={type(self.quant_method).__name__}")
