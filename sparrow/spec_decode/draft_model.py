"""Draft-model proposer: a smaller model with the target's vocabulary drafts greedily, run by the engine's own
ModelRunner (its own paged KV cache, CUDA graphs for its decode rows) and BlockManager.

Each target sequence has a mirror sequence in the draft's cache holding the same tokens. A proposal for k'
drafts is k' steps of the draft: the first computes the rows the draft has not seen (after the target accepted
a drafts, the last accepted draft and the bonus token; the whole prompt at first) and takes the argmax of its
last row; each next step is one row fed on the device with the draft token before it, so the host reads the
drafts once, after the last step. Before a proposal the mirror takes the target's tokens: its computed rows are
cut to the longest common prefix (rejected drafts' K/V are dropped, their blocks given back).
"""
from __future__ import annotations

import torch

from sparrow.config import EngineConfig
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.model_runner import ModelRunner
from sparrow.engine.sequence import Sequence
from sparrow.engine.step_plan import ScheduledSeq, StepPlan
from sparrow.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class _Mirror:
    """The draft's copy of one target sequence; ``synced``: target outputs it held at the last proposal."""

    __slots__ = ("seq", "synced", "past_vocab")

    def __init__(self, target: Sequence, vocab_size: int):
        self.seq = Sequence(target.request_id, target.index, target.prompt_token_ids, _GREEDY, set())
        self.synced = 0
        self.past_vocab = max(target.prompt_token_ids, default=0) >= vocab_size
        """A token past the draft's vocabulary (a padded target vocabulary's): the sequence gets no drafts."""


class DraftModelProposer:
    def __init__(self, config: EngineConfig, model: torch.nn.Module):
        """``config``: the draft's engine config (the target's settings with the draft's ModelConfig, a KV pool of
        as many blocks as the target's and no LoRA: the draft runs the base model for every request)."""
        self.runner = ModelRunner(config, model, query_lens=(1, 2))
        self.vocab_size = config.model.vocab_size
        self.bm = BlockManager(self.runner.num_blocks, config.cache.block_size, enable_prefix_caching=False)
        self._mirrors: dict[Sequence, _Mirror] = {}

    def release(self, seq: Sequence) -> None:
        """Free the mirror of a sequence that left the running batch."""
        mirror = self._mirrors.pop(seq, None)
        if mirror is not None:
            self.bm.free_seq(mirror.seq)

    def _sync(self, target: Sequence) -> Sequence:
        """The mirror of ``target`` with the target's tokens, its computed rows cut to the common prefix."""
        mirror = self._mirrors.get(target)
        if mirror is None:
            mirror = self._mirrors[target] = _Mirror(target, self.vocab_size)
        m, out = mirror.seq, target.output_token_ids
        mirror.past_vocab |= max(out[mirror.synced:], default=0) >= self.vocab_size
        mine = m.output_token_ids
        i = mirror.synced
        while i < len(mine) and i < len(out) and mine[i] == out[i]:
            i += 1
        common = m.num_prompt_tokens + i
        del mine[i:]
        mine.extend(out[i:])
        mirror.synced = len(out)
        if m.num_computed_tokens > common:
            m.num_computed_tokens = common
            self.bm.truncate(m, common)
        return m

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (target sequence, most drafts k') up to k' greedy draft tokens (none for a sequence with
        soft embeddings or a token past the draft's vocabulary, or when the draft's KV pool has no room for it)."""
        items: list[tuple[int, Sequence, int]] = []  # (request index, mirror, drafts)
        for r, (target, k) in enumerate(requests):
            if target.soft_embeds is not None:
                continue
            m = self._sync(target)
            if self._mirrors[target].past_vocab:
                continue
            need = m.num_tokens + k - 1  # rows computed after the last draft step (the last draft is not fed)
            if not self.bm.can_allocate(m, need):
                self.release(target)
                continue
            self.bm.allocate(m, need)
            items.append((r, m, k))
        drafts: list[list[int]] = [[] for _ in requests]
        if not items:
            return drafts
        # step 1: the rows the draft has not computed; all sampled when they fit a graph (q <= 2), else the last
        first = []
        for _, m, _ in items:
            n = m.num_tokens - m.num_computed_tokens
            first.append(ScheduledSeq(m, m.num_computed_tokens, n, num_sampled=n if n <= 2 else 1))
        plan = StepPlan(first, argmax_only=True)
        result = self.runner.run(plan)
        results, rows = [result], []
        end = 0
        for item in first:
            end += item.num_sampled
            rows.append(end - 1)  # the row of each mirror's first draft in ``result``
        for _, m, _ in items:
            m.num_computed_tokens = m.num_tokens
        picks = [[(0, row)] for row in rows]  # per item: (result index, row) of each draft
        live = list(range(len(items)))
        for step in range(1, max(k for _, _, k in items)):
            live = [i for i in live if items[i][2] > step]
            if not live:
                break
            plan = StepPlan([ScheduledSeq(items[i][1], items[i][1].num_tokens + step - 1, 1, num_sampled=1,
                                          fed_row=picks[i][-1][1]) for i in live], argmax_only=True)
            result = self.runner.run(plan, previous=results[-1])  # each row fed its draft of the step before
            results.append(result)
            for j, i in enumerate(live):
                picks[i].append((len(results) - 1, j))
                items[i][1].num_computed_tokens += 1
        host = [res.token_ids() for res in results]
        for (r, m, _), pick in zip(items, picks):
            drafts[r] = [host[res][row] for res, row in pick]
            m.output_token_ids.extend(drafts[r])
        return drafts

