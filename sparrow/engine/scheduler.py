"""Continuous batching: the waiting and running queues, the per-step token budget, chunked prefill, preemption
(by recomputation: a preempted sequence frees its blocks and goes back to the front of the waiting queue; its
prompt and output so far are prefilled again when it is readmitted), and the overlap decision.

Each step, running sequences go first (a decode needs one row, or 1 + k' rows to verify k' draft tokens from the
speculator, ``engine.speculator``, when they fit the budget and free blocks; an unfinished prefill takes a chunk),
then waiting sequences are admitted in order while the budget, ``max_num_seqs`` and free blocks allow; one whose
grammar (structured output) is still compiling stays waiting and the ones behind it are admitted. LoRA adapter slots
(``max_loras`` distinct adapters among the running sequences): a sequence whose adapter finds none free waits, the
adapter sequences behind it too (in order), and base-model sequences behind it, which take no slot, are admitted
past it; the plan's adapters take device slots (``LoRAManager.assign``: ``StepPlan.lora_slots``), and a request
whose adapter cannot be read again leaves the plan (``StepPlan.failed``). A waiting sequence that cannot be
admitted holds no blocks (the prefix-cache hits it took are given back), so it never starves the running ones. A
plan whose rows are all plain greedy decode rows of every running sequence, with nothing waiting, may queue the
next step before it is read (``queue_next``; ``switches.OVERLAP``): ``schedule_ahead`` plans that step (allocating
its blocks as for any other) from the queued one.
"""
from __future__ import annotations

from collections import deque

from sparrow import switches
from sparrow.config import SchedulerConfig
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.sampler import argmax_only
from sparrow.engine.sequence import Sequence, SequenceStatus
from sparrow.engine.speculator import Speculator
from sparrow.engine.step_plan import ScheduledSeq, StepPlan
from sparrow.lora.manager import LoRAManager


def _plain_decode(item: ScheduledSeq) -> bool:
    """One greedy decode row whose sampling is the argmax (what a queued next step can follow on the device); a
    constrained row (structured output) never is: its next mask needs this step's token on the host."""
    seq = item.seq
    return (item.num_new_tokens == 1 and item.num_sampled == 1 and not item.draft_token_ids and seq.grammar is None
            and item.start >= seq.num_prompt_tokens and seq.params.prompt_logprobs is None
            and argmax_only(seq.params, len(seq.output_token_ids)))


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int | None = None,
                 max_loras: int | None = None, lora: LoRAManager | None = None,
                 speculator: Speculator | None = None):
        """``max_loras``: most distinct LoRA adapters among the running sequences (the device's adapter slots);
        a waiting sequence of another adapter waits until a running adapter's sequences are done, and later
        sequences with an adapter wait behind it. ``lora``: the LoRA manager whose device slots each plan's
        adapters take (``plan.lora_slots``); None: LoRA is off. ``speculator``: speculative decoding
        (``sparrow.engine.speculator``): its drafts go into the plans, its ``accept`` counts what a step accepted;
        None: off."""
        self.config = config
        self.max_loras = max_loras
        self.lora = lora
        self.spec = speculator
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def lora_adapter_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapter names (``lora_name``) of the running and of the waiting sequences, each name once, in
        queue order (vLLM's ``lora_requests_info`` labels)."""
        def names(seqs):
            return tuple(dict.fromkeys(s.lora_request.lora_name for s in seqs if s.lora_request is not None))
        return names(self.running), names(self.waiting)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _item(self, seq: Sequence, n: int) -> ScheduledSeq:
        reaches_end = seq.num_computed_tokens + n == seq.num_tokens
        return ScheduledSeq(seq, seq.num_computed_tokens, n, num_sampled=1 if reaches_end else 0)

    def _verify_item(self, seq: Sequence, drafts: list[int], budget: int) -> ScheduledSeq | None:
        """The verify rows of a decode-phase sequence with draft tokens: its last token and the drafts that fit
        the budget, all sampled, when their K/V slots fit without preemption (allocated here); else None."""
        drafts = drafts[:budget - 1]
        if not drafts or seq.num_computed_tokens != seq.num_tokens - 1:
            return None
        n = 1 + len(drafts)
        if not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            return None
        self.bm.allocate(seq, seq.num_computed_tokens + n)
        return ScheduledSeq(seq, seq.num_computed_tokens, n, num_sampled=n, draft_token_ids=drafts)

    def schedule(self) -> StepPlan:
        """Plan the next step: running sequences, then waiting ones (the module doc), then the adapters' device
        slots. With a speculator, a running sequence it drafts for (``Speculator.propose``) verifies the drafts
        in k + 1 rows when they fit the budget and free blocks, else it decodes one row."""
        drafts = self.spec.propose(self.running, len(self.waiting)) if self.spec is not None else None
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted below to make room for an earlier one
                continue
            if drafts and seq in drafts:
                item = self._verify_item(seq, drafts[seq], budget)
                if item is not None:
                    out.append(item)
                    budget -= item.num_new_tokens
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
            out.append(self._item(seq, n))
            budget -= n
        adapters = {s.lora_int_id for s in self.running} - {0}
        held: list[Sequence] = []  # sequences left waiting, in order (grammar compiling, adapter slots taken)
        lora_held = False  # an adapter sequence found every slot taken: later adapter sequences wait behind it
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.grammar is not None and not seq.grammar.ready:
                held.append(self.waiting.popleft())  # its grammar compiles on another thread: the rest go on
                continue
            if seq.lora_int_id and (lora_held or (seq.lora_int_id not in adapters
                                                  and len(adapters) >= (self.max_loras or 0))):
                held.append(self.waiting.popleft())  # base-model sequences behind it take no slot: they go on
                lora_held = True
                continue
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
                            f"KV cache of {self.bm.num_blocks} blocks cannot hold a single chunk of a sequence")
                else:
                    self._release_waiting(seq)
                    break
            self.waiting.popleft()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora_int_id:
                adapters.add(seq.lora_int_id)
            out.append(self._item(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        plan = StepPlan(out)
        sampled = [item for item in out if item.samples]
        plan.argmax_only = all(argmax_only(i.seq.params, len(i.seq.output_token_ids)) for i in sampled)
        plan.queue_next = (switches.OVERLAP and bool(out) and not self.waiting
                           and len(out) == len(self.running) and all(_plain_decode(i) for i in out))
        self._slot_adapters(plan)
        return plan

    def _slot_adapters(self, plan: StepPlan) -> None:
        """Put the plan's LoRA adapters into device slots (``LoRAManager.assign``, into ``plan.lora_slots``). A
        request whose adapter cannot be read again (its host copy was dropped and its folder is gone or changed)
        leaves the plan, its LoRAAdapterError in ``plan.failed``; the plan's other requests run."""
        if self.lora is None:
            return
        wanted = {item.seq.lora_int_id: item.seq.lora_request for item in plan.seqs if item.seq.lora_int_id}
        plan.lora_slots, errors = self.lora.assign(wanted)
        if not errors:
            return
        plan.failed = {item.seq.request_id: errors[item.seq.lora_int_id] for item in plan.seqs
                       if item.seq.lora_int_id in errors}
        plan.seqs = [item for item in plan.seqs if item.seq.request_id not in plan.failed]

    def _release_waiting(self, seq: Sequence) -> None:
        """A waiting sequence that cannot be admitted gives back the prefix-cache blocks it took (their hashes
        stay, so it finds them again later unless they were reused)."""
        self.bm.free_seq(seq)
        seq.num_computed_tokens = seq.num_cached_prefix_tokens = 0

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The decode step after ``plan`` (a ``queue_next`` plan, queued but not read), fed on the device by its
        sampled ids: every sequence of ``plan`` that does not end on length with ``plan``'s token, when nothing
        waits, all running sequences are in ``plan``, no sequence would get drafts (``Speculator.paused``: a
        queued step carries none) and their next K/V slots fit without preemption (allocated here). None when it
        cannot be queued."""
        if self.spec is not None and not self.spec.paused([item.seq for item in plan.seqs]):
            return None
        if self.waiting or len(plan.seqs) != len(self.running):
            return None
        items = []
        for i, item in enumerate(plan.seqs):
            seq = item.seq
            if seq.is_finished:
                return None
            if seq.at_length_limit(self.max_model_len, coming=1):  # ends with the queued step's token
                continue
            items.append(ScheduledSeq(seq, item.start + 1, 1, num_sampled=1, fed_row=i))
        if not items or not all(_plain_decode(i) for i in items):
            return None
        if sum(self.bm.blocks_needed(i.seq, i.start + 1) for i in items) > self.bm.num_free_blocks:
            return None
        for i in items:
            self.bm.allocate(i.seq, i.start + 1)
        # its sequences are plan's: their adapters are in plan's slots
        return StepPlan(items, queue_next=True, argmax_only=True, lora_slots=plan.lora_slots)

    def commit(self, item: ScheduledSeq, sampled: list[int]) -> int:
        """After the step ran, with ``sampled``, the ids sampled at the item's rows: the rows holding the
        sequence's tokens and its accepted draft tokens (``Speculator.accept``) are computed; the slots of
        rejected draft tokens are given back (``BlockManager.truncate``). Returns the accepted drafts' count (the
        engine appends ``sampled[:count + 1]``)."""
        num_accepted_drafts = 0
        if item.draft_token_ids and self.spec is not None:
            num_accepted_drafts = self.spec.accept(item, sampled)
        seq = item.seq
        seq.num_computed_tokens = item.start + item.num_verified + num_accepted_drafts
        if num_accepted_drafts < len(item.draft_token_ids):
            self.bm.truncate(seq, seq.num_computed_tokens + 1)  # + 1: the slot of the token sampled after them
        self.bm.commit_computed(seq)
        return num_accepted_drafts

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        if self.spec is not None:
            self.spec.release(seq)
