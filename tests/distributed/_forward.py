"""A model's prefill logits without an engine: the prompts as one step's sequences over a fresh paged KV cache
(``prefill_logits``), and greedy continuation from them (``greedy``); on the model's device, logits returned on the CPU, for comparing parallel ranks with one rank."""
from __future__ import annotations

import torch

from sparrow.kv_cache import KVCache
from sparrow.layers.forward_batch import ForwardBatch

BLOCK = 16


@torch.inference_mode()
def prefill_logits(model, prompts: list[list[int]], adapter_slot: int | None = None) -> torch.Tensor:
    """fp32 logits [sum(len(p)), V] of every row of ``prompts`` run as one prefill step (sequences in order);
    ``adapter_slot``: every row runs the LoRA adapter in that slot."""
    first_param = next(p for p in model.parameters() if p.is_floating_point())
    dtype, device = first_param.dtype, first_param.device
    blocks = [-(-len(p) // BLOCK) for p in prompts]
    KVCache(model, sum(blocks), BLOCK, dtype, device)
    ids, pos, slots, starts, tables = [], [], [], [0], []
    width, first = max(blocks), 0
    for p, nb in zip(prompts, blocks):
        own = list(range(first, first + nb))
        ids += p
        pos += range(len(p))
        slots += [own[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(p))]
        starts.append(starts[-1] + len(p))
        tables.append(own + [sum(blocks)] * (width - nb))
        first += nb
    rows = len(ids)
    on = dict(device=device)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, **on), positions=torch.tensor(pos, **on), slot_mapping=torch.tensor(slots, **on),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, **on),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32, **on),
        block_tables=torch.tensor(tables, dtype=torch.int32, **on), max_query_len=max(map(len, prompts)),
        max_seq_len=max(map(len, prompts)), sample_rows=torch.arange(rows, **on),
        adapter_ids=None if adapter_slot is None else torch.full((rows,), adapter_slot, dtype=torch.int32, **on))
    return model.compute_logits(model(batch)).cpu()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy ids after ``prompt`` (each step re-runs the prefill of the grown sequence: tiny models only)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(prefill_logits(model, [seq])[-1].argmax()))
    return seq[len(prompt):]
