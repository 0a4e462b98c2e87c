"""Token embedding, optionally scaled (Gemma: x sqrt(H), the scale cast to the table dtype as HF does),
with soft-token injection: rows marked as soft take caller-supplied vectors instead of a table row.

Vocab-parallel (tensor_parallel_size T > 1, vLLM's VocabParallelEmbedding): rank r holds table rows
[r V', (r + 1) V') with V' = ceil(V / T) (rows past V are zeros), looks up the ids in its range (the others give
zero rows) and one all-reduce sums the ranks' rows. ``VocabEmbedding.vocab_range`` is this rank's range; an
untied LM head is sharded the same way (``vocab_shard_loader``) and the logits gathered
(``sparrow.layers.logits.gather_logits``)."""
from __future__ import annotations

import torch
from torch import nn

from sparrow.distributed import get_tp


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """(first row, rows held) of this rank's share of a [V, H] table: V' = ceil(V / T) rows from r V'."""
    tp = get_tp()
    rows = -(-vocab_size // tp.world_size)
    return tp.rank * rows, rows


def vocab_shard_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Copy this rank's rows of a [V, H] checkpoint table into ``param`` [V', H] (rows past V zeroed); ModelLoadError
    on a misshaped tensor."""
    from sparrow.errors import ModelLoadError

    start, rows = param.vocab_range
    if loaded.dim() != 2 or loaded.shape[1] != param.shape[1] or loaded.shape[0] != param.vocab_size:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected "
                             f"{(param.vocab_size, param.shape[1])}")
    have = max(0, min(rows, param.vocab_size - start))
    param.data[:have].copy_(loaded[start:start + have])
    param.data[have:].zero_()


def make_vocab_param(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Parameter:
    """A [V, H] table parameter, or this rank's [V', H] share of it (loaded by ``vocab_shard_loader``)."""
    if get_tp().world_size == 1:
        return nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
    start, rows = vocab_range(vocab_size)
    param = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
    param.weight_loader, param.vocab_range, param.vocab_size = vocab_shard_loader, (start, rows), vocab_size
    param.checkpoint_shape = (vocab_size, hidden_size)
    return param


class VocabEmbedding(nn.Module):
    """weight [V, H] (vocab-parallel: [V', H], module doc); forward(input_ids [R]) -> [R, H] in the weight dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = make_vocab_param(vocab_size, hidden_size, dtype)
        self.vocab_range = getattr(self.weight, "vocab_range", (0, vocab_size))
        self.scale = scale

    def forward(self, input_ids: torch.Tensor, soft_embeds: torch.Tensor | None = None,
                soft_mask: torch.Tensor | None = None) -> torch.Tensor:
        """soft_embeds [n_soft, H] replace the rows where soft_mask [R] (bool) is True, unscaled
        (as transformers' ``inputs_embeds`` path: the caller's vectors go in as given)."""
        tp = get_tp()
        if tp.world_size == 1:
            x = self.weight[input_ids.clamp(min=0)]
        else:
            start, rows = self.vocab_range
            local = input_ids - start
            mine = (local >= 0) & (local < rows)
            x = self.weight[torch.where(mine, local, 0)] * mine.unsqueeze(-1).to(self.weight.dtype)
            x = tp.all_reduce(x)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if soft_embeds is not None:
            x = x.clone()
            x[soft_mask] = soft_embeds.to(x.dtype)
        return x
