"""What the scheduler decides for one step (``StepPlan``) and what running it gives back (``StepResult``).

A step is one list of ``ScheduledSeq``: each sequence contributes rows (a prefill chunk, one decode row, or k + 1
rows verifying k draft tokens), the last ``num_sampled`` of them are sampled, and the engine may accept up to
``num_sampled`` tokens from them. ``StepPlan.queue_next`` lets the engine queue the next step before it reads
this one (overlapped decode); such a queued step's rows take their input tokens from this step's sampled ids on
the device (``ScheduledSeq.fed_row``).

Shapes: R' = sampled rows of the step (in plan order), V = vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparrow.engine.sequence import Sequence
from sparrow.errors import SparrowError


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's part of a step."""

    seq: Sequence
    start: int
    """Position of the first row (the sequence's computed tokens when the step was planned)."""
    num_new_tokens: int
    """Rows: a prefill chunk, 1 for decode, k + 1 to verify k draft tokens."""
    num_sampled: int = 0
    """The last rows that are sampled: 0 for a prefill chunk short of the end, 1 for a decode row or a last
    prefill chunk, k + 1 for a verify step. The step may accept up to this many tokens."""
    draft_token_ids: list[int] | tuple[int, ...] = ()
    """The k draft tokens the last k rows verify (after the sequence's last token)."""
    fed_row: int | None = None
    """A queued step's decode row: its input token is row ``fed_row`` of the previous step's sampled ids, on the
    device (the host has not read it yet)."""

    @property
    def samples(self) -> bool:
        return self.num_sampled > 0

    @property
    def num_verified(self) -> int:
        """Rows that hold tokens the sequence already has (the rows before the draft tokens)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    def input_ids(self) -> list[int]:
        """The rows' input tokens (0 for a fed row: the device fills it in)."""
        if self.fed_row is not None:
            return [0]
        tokens = self.seq.tokens(self.start, self.start + self.num_verified)
        return tokens + list(self.draft_token_ids) if self.draft_token_ids else tokens


@dataclass
class StepPlan:
    """The scheduler's step: its sequences in row order, and whether the next step may be queued before this one
    is read (every row a plain greedy decode row: the next rows' inputs are this step's argmax ids)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    queue_next: bool = False
    argmax_only: bool = False
    """Every sampled row takes the argmax of its logits (greedy, no penalties, no logprobs): the sampler is
    skipped."""
    lora_slots: dict[int, int] | None = None
    """lora_int_id -> device slot of each LoRA adapter the plan runs (the scheduler's ``LoRAManager.assign``);
    None: LoRA is off (every row runs the base model)."""
    failed: dict[str, SparrowError] = field(default_factory=dict)
    """Requests the planning ended (request id -> error): a request whose LoRA adapter could not be read again
    (its host copy was dropped and its folder is gone or changed). Their rows left the plan; the engine ends them."""

    def __iter__(self):
        return iter(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def max_query_len(self) -> int | None:
        """The most rows of a sequence when every sequence's rows are all sampled (a decode or verify step a CUDA
        graph of q >= that many rows per sequence can replay, shorter sequences padded); else None."""
        if not self.seqs or any(s.num_sampled != s.num_new_tokens for s in self.seqs):
            return None
        return max(s.num_new_tokens for s in self.seqs)


class StepResult:
    """A step's sampled ids: ``tokens`` [R'] int64 on the device (what a queued next step is fed) and, on CUDA, a
    copy on its way to pinned host memory behind an event, so reading them waits for this step only, not for a
    step queued after it on the same stream. ``logprobs`` [R'] (None entries where not asked) and
    ``prompt_logprobs`` {plan index: rows} are host values, present only on steps that asked for them."""

    def __init__(self, tokens: torch.Tensor, logprobs: list | None = None, prompt_logprobs: dict | None = None):
        self.tokens = tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs or {}
        self._host, self._ready = tokens, None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def token_ids(self) -> list[int]:
        """[R'] the sampled ids on the host (waits for this step's copy)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
