"""The step's batch as every layer sees it: built by the ModelRunner from a StepPlan, passed down the model.

Shapes: R = rows of the step, S = sequences, M = blocks per sequence (the step's longest table, or the decode
graphs' max), R' = rows whose logits are computed, H = hidden size, N = soft-token rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One step's inputs and layout (vLLM's attention metadata plus the inputs), on the model's device."""

    input_ids: torch.Tensor
    """[R] int64: the token of each row."""
    positions: torch.Tensor
    """[R] int64: position of each row's token in its sequence."""
    slot_mapping: torch.Tensor
    """[R] int64: KV-pool slot (block * B + offset) where each row's K/V is written."""
    query_start_loc: torch.Tensor
    """[S+1] int32: rows of sequence s are query_start_loc[s]:query_start_loc[s+1]."""
    seq_lens: torch.Tensor
    """[S] int32: tokens of sequence s in the cache after this step (cached + new)."""
    block_tables: torch.Tensor
    """[S, M] int32: KV blocks of each sequence, in order (entries past a sequence's blocks are the pad block)."""
    max_query_len: int
    """Longest q_len of the step (1 for a pure decode step, k + 1 for a verify step of k draft tokens)."""
    max_seq_len: int
    """Longest seq_len of the step (an upper bound in CUDA graphs)."""
    sample_rows: torch.Tensor
    """[R'] int64: rows whose logits are computed and sampled (vLLM's logits_indices)."""
    soft_embeds: torch.Tensor | None = None
    """[N, H] vectors that replace the embedding of the rows marked in ``soft_mask`` (in row order)."""
    soft_mask: torch.Tensor | None = None
    """[R] bool: rows that take the next vector of ``soft_embeds``; None when no row does."""
    adapter_ids: torch.Tensor | None = None
    """[R] int32 (int64 in CUDA graphs): each row's LoRA adapter slot (-1: the base model); None when the step has
    no adapter rows (eager steps) or LoRA is off."""
