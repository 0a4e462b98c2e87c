"""Speculative decoding as the engine sees it: the ``Speculator`` interface. ``sparrow.spec_decode`` implements
it (``SpeculativeDecoder``); the engine is given one (``Engine(..., make_speculator=...)``) and never imports the
decoder, whose draft-model proposer runs on the engine's own ModelRunner and BlockManager.

One step, end to end:
- ``Scheduler.schedule`` asks ``propose`` for the running sequences' drafts and plans k' + 1 verify rows for a
  sequence whose drafts fit (``ScheduledSeq.draft_token_ids``), one decode row otherwise;
- before queuing a decode step behind the running one (overlap: a queued step cannot carry drafts, its inputs are
  not on the host yet), ``Scheduler.schedule_ahead`` asks ``paused``;
- once the step's tokens are read, ``Scheduler.commit`` asks ``accept`` how many of an item's drafts the sampled
  ids accept (the rejected drafts' KV slots are given back), and the engine appends those and the token after;
- ``Scheduler.finish`` gives a sequence that ended or was aborted to ``release``;
- the engine gives ``step_done`` each plan it applied (the decoder times its steps to decide when verifying pays).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from sparrow.config import EngineConfig
from sparrow.engine.sequence import Sequence
from sparrow.engine.step_plan import ScheduledSeq, StepPlan


class Speculator(Protocol):
    def propose(self, running: list[Sequence], waiting: int = 0) -> dict[Sequence, list[int]]:
        """Draft tokens for some of the ``running`` sequences (none: {}); ``waiting``: requests queued for a
        slot."""

    def paused(self, seqs: list[Sequence]) -> bool:
        """Whether none of ``seqs`` would get drafts in the next steps: a decode step may then be queued ahead."""

    def accept(self, item: ScheduledSeq, sampled: list[int]) -> int:
        """How many of ``item``'s drafts the ids ``sampled`` at its rows accept (counted for the decoder's
        statistics and back-off)."""

    def release(self, seq: Sequence) -> None:
        """Forget a sequence that finished or was aborted."""

    def step_done(self, plan: StepPlan) -> None:
        """The engine applied ``plan`` (called after every step, at its end)."""

    def metrics(self) -> dict:
        """Counters for ``LLM.get_metrics`` and the server's /metrics."""


MakeSpeculator = Callable[[EngineConfig, int, "torch.nn.Module | None"], Speculator]
"""(engine config, KV blocks of the target's pool, the draft model or None) -> the speculator of
``config.speculative`` (``sparrow.spec_decode.make_speculative_decoder``)."""
