"""StepPlan -> the step's rows on the host (``StepRows``) -> a ForwardBatch on the device.

Shapes: R = rows of the step, S = sequences, M = the step's widest block table, R' = sampled rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparrow.engine.step_plan import StepPlan, StepResult
from sparrow.layers.forward_batch import ForwardBatch


@dataclass
class StepRows:
    """A plan's rows as host lists (sequence by sequence, rows in order)."""

    input_ids: list[int] = field(default_factory=list)
    """[R] (0 in rows fed on the device)."""
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    """[R'] the last ``num_sampled`` rows of each sequence."""
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    """(plan index, first row, count) of rows whose next token is a prompt token (prompt logprobs)."""
    soft_vecs: list[torch.Tensor] = field(default_factory=list)
    soft_mask: list[bool] = field(default_factory=list)
    adapter_ids: list[int] | None = None
    """[R] the LoRA slot of each row (-1: base model); None when LoRA is off."""


@dataclass
class StepInputs:
    """Everything a rank needs to run one step's forward and logits calls: what rank 0 broadcasts to the other
    tensor-parallel ranks before its own forward (``sparrow.engine.workers``), and what every rank's
    ``ModelRunner.execute`` runs. Host values only (pickled in one broadcast); fed tokens follow as a tensor."""

    rows: StepRows
    """The rows (padded to ``graph_q`` rows per sequence when ``keep`` is set; soft vectors on the CPU)."""
    graph_q: int | None = None
    """q of the CUDA graph (bucket of len(rows.seq_lens) sequences) that runs the step; None: eager."""
    keep: list[int] | None = None
    """[R'] rows of a padded graph step that are real (their logits are kept); None: every row."""
    num_fed: int = 0
    """Rows whose input ids are fed on the device (the previous step's sampled ids, [num_fed] int64)."""
    measure_kv_scales: bool = False
    """Rank 0's KV cache measures its pending FP8 scales in this (eager prefill) step: the others do too."""
    lora_slots: list = field(default_factory=list)
    """(slot, LoRARequest or None) of each LoRA slot rank 0 wrote (None: cleared) since the last step."""


def step_rows(plan: StepPlan, block_size: int, lora_slots: dict[int, int] | None = None) -> StepRows:
    """The rows of ``plan``: a sequence's rows are positions start .. start + num_new_tokens - 1, their K/V
    slots read from its block table (allocated by the scheduler). ``lora_slots``: lora_int_id -> adapter slot of
    the plan's adapters when LoRA is on (rows of the base model get -1)."""
    r, bs = StepRows(), block_size
    if lora_slots is not None:
        r.adapter_ids = []
    for i, item in enumerate(plan.seqs):
        seq, n, start = item.seq, item.num_new_tokens, item.start
        row0 = len(r.input_ids)
        if lora_slots is not None:
            r.adapter_ids += [lora_slots.get(seq.lora_int_id, -1)] * n
        r.input_ids += item.input_ids()
        r.positions += range(start, start + n)
        table = seq.block_table
        r.slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        if seq.soft_embeds is not None:
            index = {p: j for j, p in enumerate(seq.soft_positions)}
            for p in range(start, start + n):
                j = index.get(p)
                r.soft_mask.append(j is not None)
                if j is not None:
                    r.soft_vecs.append(seq.soft_embeds[j])
        else:
            r.soft_mask += [False] * n
        r.query_start_loc.append(len(r.input_ids))
        r.seq_lens.append(start + n)
        r.block_tables.append(table)
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
            m = min(n, seq.num_prompt_tokens - 1 - start)
            if m > 0:
                r.prompt_rows.append((i, row0, m))
        end = len(r.input_ids)
        r.sample_rows += range(end - item.num_sampled, end)
    return r


def pad_rows(plan: StepPlan, rows: StepRows, q: int, pad_slot: int, block_size: int) -> tuple[StepRows, list[int]]:
    """``rows`` (every row sampled) with each sequence padded to q rows for a CUDA graph of q rows per sequence,
    and the indices [R'] of the real rows among the n q. A padding row repeats the sequence's last position
    (its output is dropped), writes its K/V to the pad block and the sequence's seq_len counts q rows, so its
    real rows keep their positions under the causal mask and never see a padding row's K/V."""
    out, keep = StepRows(), []
    if rows.adapter_ids is not None:
        out.adapter_ids = []
    r = 0
    for i, item in enumerate(plan.seqs):
        n = item.num_new_tokens
        extra = q - n
        if out.adapter_ids is not None:
            out.adapter_ids += rows.adapter_ids[r:r + n] + [-1] * extra
        out.input_ids += rows.input_ids[r:r + n] + [0] * extra
        out.positions += rows.positions[r:r + n] + [rows.positions[r + n - 1]] * extra
        out.slot_mapping += rows.slot_mapping[r:r + n] + [pad_slot + j % block_size for j in range(extra)]
        out.seq_lens.append(item.start + q)
        out.block_tables.append(rows.block_tables[i])
        keep += range(i * q, i * q + n)
        r += n
    return out, keep


def fed_tokens(plan: StepPlan, previous: StepResult | None) -> torch.Tensor | None:
    """[S] int64 on the device: the input tokens of a queued step's rows (one row per sequence, each row
    ``fed_row`` of ``previous``'s sampled ids); None when the plan's inputs are all on the host. Raises
    ValueError for a plan that mixes fed and host rows or lacks the previous step."""
    rows = [item.fed_row for item in plan.seqs]
    if all(r is None for r in rows):
        return None
    if previous is None or any(r is None for r in rows) or any(s.num_new_tokens != 1 for s in plan.seqs):
        raise ValueError("a step fed on the device needs the previous step and one fed row per sequence")
    tokens = previous.tokens
    if rows == list(range(tokens.shape[0])):
        return tokens
    return tokens[torch.tensor(rows, device=tokens.device)]


def block_table_tensor(tables: list[list[int]], pad_block: int) -> torch.Tensor:
    """[S, M] int32 CPU tensor of the sequences' blocks, padded with the pad block."""
    bt = torch.full((len(tables), max(len(t) for t in tables)), pad_block, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return bt


def forward_batch(rows: StepRows, feed: torch.Tensor | None, pad_block: int, device: torch.device) -> ForwardBatch:
    """The ForwardBatch of ``rows`` on ``device`` (``feed``: the input ids when the rows are fed on the device)."""
    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    soft = rows.soft_vecs
    lora = rows.adapter_ids is not None and any(s >= 0 for s in rows.adapter_ids)
    return ForwardBatch(
        input_ids=feed if feed is not None else dev(rows.input_ids, torch.int64),
        positions=dev(rows.positions, torch.int64),
        slot_mapping=dev(rows.slot_mapping, torch.int64),
        query_start_loc=dev(rows.query_start_loc, torch.int32),
        seq_lens=dev(rows.seq_lens, torch.int32),
        block_tables=block_table_tensor(rows.block_tables, pad_block).to(device, non_blocking=True),
        max_query_len=max(b - a for a, b in zip(rows.query_start_loc, rows.query_start_loc[1:])),
        max_seq_len=max(rows.seq_lens),
        sample_rows=dev(rows.sample_rows, torch.int64),
        soft_embeds=torch.stack(soft).to(device) if soft else None,
        soft_mask=torch.tensor(rows.soft_mask, dtype=torch.bool, device=device) if soft else None,
        adapter_ids=dev(rows.adapter_ids, torch.int32) if lora else None,
    )
