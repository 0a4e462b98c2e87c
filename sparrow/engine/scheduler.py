"""Continuous batching: the waiting and running queues, the per-step token budget, chunked prefill and
preemption (by recomputation: a preempted sequence frees its blocks and goes back to the front of the
waiting queue; its prompt and output so far are prefilled again when it is readmitted).

Each step, running sequences go first (a decode needs one token; an unfinished prefill takes a chunk),
then waiting sequences are admitted while the budget, ``max_num_seqs`` and free blocks allow.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sparrow.config import SchedulerConfig
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Rows this sequence contributes to the step (1 for decode, a chunk for prefill)."""

    @property
    def samples(self) -> bool:
        """True when the step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted below to make room for an earlier one
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_cached_prefix_tokens = self.bm.allocate_prefix(seq)
                seq.num_computed_tokens = seq.num_cached_prefix_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                if not self.running and not out:
                    # nothing else holds blocks: the pool is too small for even one chunk
                    n = (self.bm.num_free_blocks + len(seq.block_table)) * self.bm.block_size - seq.num_computed_tokens
                    if n <= 0:
                        raise RuntimeError(
                            f"KV cache of {self.bm.num_blocks} blocks cannot hold a single chunk of a sequence"
                        )
                else:
                    break
            self.waiting.popleft()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
