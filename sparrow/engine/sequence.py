"""One generated sequence: its tokens, its KV blocks and its progress. A request with n > 1 owns n of them."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from sparrow.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's `in` / `remove` on its lists must not compare token lists
class Sequence:
    request_id: str
    index: int
    """Position among the request's n sequences."""
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: set[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache."""
    num_cached_prefix_tokens: int = 0
    """Of those, tokens found in the prefix cache when the sequence was admitted."""
    generator: torch.Generator | None = None
    detokenizer: object = None
    text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    soft_embeds: torch.Tensor | None = None
    """[n_soft, H] vectors injected at ``soft_positions`` instead of embedding-table rows."""
    soft_positions: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_ids))
    prefix_hashes: list[int] | None = None
    """The block manager's hashes of the prompt's full blocks (computed once: the prompt never changes)."""
    num_committed_blocks: int = 0
    """Leading prompt blocks already registered in the prefix cache (reset when the blocks are freed)."""
    num_sent_chars: int = 0
    """Characters of ``text`` already reported in a RequestOutput (the rest is held back for stop strings)."""
    lora_request: object = None
    """The LoRARequest the sequence runs with (None: the base model)."""
    grammar: object = None
    """Its ``sparrow.engine.grammar.SequenceGrammar`` when ``params.structured_outputs`` is set."""

    @property
    def lora_int_id(self) -> int:
        """The adapter's lora_int_id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output (without joining the two lists: a decode row costs O(1))."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def at_length_limit(self, max_model_len: int, coming: int = 0) -> bool:
        """Whether the sequence ends on length (max_tokens, or max_model_len tokens in all) with ``coming`` more
        tokens appended."""
        p = self.params
        return ((p.max_tokens is not None and len(self.output_token_ids) + coming >= p.max_tokens)
                or self.num_tokens + coming >= max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
