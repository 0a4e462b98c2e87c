"""The engine facade: add_request / step / has_unfinished_requests (style.md 2).

Each step: the scheduler picks rows, the model runner runs them and samples, and the engine appends the
sampled tokens, detokenizes incrementally, and finishes sequences on EOS, stop token, stop string,
max_tokens or the context limit.

Overlapped greedy decode (``OVERLAP``, on by default; ``SPARROW_OVERLAP=0`` turns it off): when a step
is a plain greedy decode of every running sequence (one row each; no penalties, min_tokens, logprobs or
prompt logprobs; nothing waiting to be admitted), the engine queues the next decode step of the same sequences
before it reads this step's tokens, feeding them to the next step on the device, and reads them through a
pinned copy behind an event (``GreedyPicks``). The aim: the GPU runs step k + 1 while the host appends step
k's tokens, detokenizes and checks stop conditions (that host work left the H200 idle 0.27 ms of a 2.84 ms
batch-1 step, 0.55 of 10.19 ms at batch 64). A sequence that stops at step k (EOS, stop token or string) has
its row of step k + 1 computed and dropped; one that reaches max_tokens or the context limit is left out of
step k + 1. ``step()`` still returns each step's outputs once, in order.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import os

import torch

from sparrow.config import EngineConfig
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.detokenizer import IncrementalDetokenizer, find_stop
from sparrow.engine.model_runner import GreedyPicks, ModelRunner
from sparrow.engine.sampler import make_generator
from sparrow.engine.scheduler import Scheduler
from sparrow.engine.sequence import Sequence
from sparrow.errors import InvalidRequestError
from sparrow.outputs import CompletionOutput, Logprob, RequestOutput
from sparrow.sampling_params import SamplingParams
from sparrow.tokenizer import encode_prompt

log = logging.getLogger(__name__)

OVERLAP = os.environ.get("SPARROW_OVERLAP", "1") != "0"
"""Queue the next greedy decode step before reading this one's tokens (module doc); ``SPARROW_OVERLAP=0`` in
the environment or False here turns it off. H200, gemma4-26b-a4b FP8 with the FP8 LM head, two alternating
rounds against the same tree with it off: batch 1 382.5 / 383.2 against 337.2 / 367.6 tok/s, batch 64
6,409.9 / 6,421.5 against 5,839.1 / 6,157.0 (benchmarks/README.md, fourteenth session)."""


@dataclasses.dataclass
class _Launched:
    """A greedy decode step queued on the device: its sequences, their input positions and the picked ids
    (not read yet)."""

    seqs: list[Sequence]
    positions: list[int]
    picks: GreedyPicks


def _own_copy(params: SamplingParams) -> SamplingParams:
    """A validated copy of ``params`` that shares no list with the caller's object (``dataclasses.replace``
    runs ``__post_init__`` again)."""
    def own(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    return dataclasses.replace(params, stop=own(params.stop), stop_token_ids=own(params.stop_token_ids))


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(config, model)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, tuple[RequestOutput, list[Sequence]]] = {}
        self._ids = itertools.count()
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._ahead: _Launched | None = None  # the next decode step, queued before the last one was read

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int], torch.Tensor | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidRequestError("a dict prompt needs 'prompt_token_ids'")
            try:  # operator.index takes Python and numpy integers, refuses floats, strings and None
                ids = [operator.index(t) for t in prompt["prompt_token_ids"]]
            except TypeError:
                raise InvalidRequestError("prompt_token_ids must be a list of integer token ids") from None
            soft, pos = prompt.get("soft_embeds"), list(prompt.get("soft_positions") or [])
            if soft is not None:
                if soft.dim() != 2 or soft.shape[1] != self.config.model.hidden_size:
                    raise InvalidRequestError(
                        f"soft_embeds must be [n, {self.config.model.hidden_size}], got {tuple(soft.shape)}")
                if len(pos) != soft.shape[0] or len(set(pos)) != len(pos) or any(not 0 <= p < len(ids) for p in pos):
                    raise InvalidRequestError(
                        f"soft_positions must be {soft.shape[0]} distinct prompt positions in [0, {len(ids)})")
            return prompt.get("prompt"), ids, soft, pos
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
        return prompt, encode_prompt(self.tokenizer, prompt), None, []

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (text or {'prompt_token_ids': [...], optional 'soft_embeds', 'soft_positions'}).
        Raises InvalidRequestError for an empty prompt, one longer than max_model_len, bad token ids, or
        SamplingParams changed after construction into invalid values. The request keeps a copy of ``params``
        (validated again here), so changing the caller's object later does not touch it."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = _own_copy(params) if params is not None else SamplingParams()
        text, ids, soft, soft_pos = self._prompt_ids(prompt)
        if not ids:
            raise InvalidRequestError("empty prompt: give at least one token")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, longer than max_model_len={limit} allows (at most {limit - 1})")
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this engine runs on token ids (use stop_token_ids)")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        seqs = []
        for i in range(params.n):
            seq = Sequence(rid, i, list(ids), params, self.eos_token_ids, soft_embeds=soft, soft_positions=soft_pos)
            if params.seed is not None:
                seq.generator = make_generator(params.seed, i, self.runner.device)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            seqs.append(seq)
        out = RequestOutput(rid, text, list(ids),
                            [CompletionOutput(i, "", []) for i in range(params.n)])
        self.requests[rid] = (out, seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request, freeing its blocks."""
        _, seqs = self.requests.pop(request_id, (None, []))
        for seq in seqs:
            self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def _decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else None

    def _finish_check(self, seq: Sequence, tid: int, new_text: str) -> None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if tid in seq.eos_token_ids and not p.ignore_eos and n_out > p.min_tokens - 1:
            seq.finish_reason = "stop"
        elif p.stop_token_ids and tid in p.stop_token_ids and n_out >= p.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", tid
        elif p.stop_strings and new_text and n_out >= p.min_tokens:
            hit = find_stop(seq.text, len(new_text), p.stop_strings, p.include_stop_str_in_output)
            if hit is not None:
                seq.text = seq.text[: hit[0]]
                seq.finish_reason, seq.stop_reason = "stop", hit[1]
        if seq.finish_reason is None and self._at_length_limit(seq):
            seq.finish_reason = "length"

    def _at_length_limit(self, seq: Sequence, coming: int = 0) -> bool:
        """Whether ``seq`` ends on length (max_tokens or max_model_len) with ``coming`` more tokens appended."""
        p = seq.params
        return ((p.max_tokens is not None and len(seq.output_token_ids) + coming >= p.max_tokens)
                or seq.num_tokens + coming >= self.config.max_model_len)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the RequestOutput of every request that progressed (cumulative
        text and tokens; ``finished`` set on the last). If the step raises (an error, or Ctrl-C while the host
        waits for the GPU), its sequences may be half updated (a token sampled but not appended, a step queued
        ahead of it): every running request is aborted before the exception propagates, so the requests left
        (waiting ones) and later requests run normally."""
        try:
            return self._step()
        except BaseException:
            in_flight = {seq.request_id for seq in self.scheduler.running}
            if self._ahead is not None:
                in_flight.update(seq.request_id for seq in self._ahead.seqs)
            self._ahead = None
            for rid in in_flight:
                self.abort(rid)
            raise

    def _step(self) -> list[RequestOutput]:
        if self._ahead is not None:  # queued during the previous call: read it (queueing the one after first)
            ahead, self._ahead = self._ahead, None
            return self._complete(ahead)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        if OVERLAP and self._overlappable([item.seq for item in scheduled]) and all(
                item.num_new_tokens == 1 and item.samples and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens
                for item in scheduled):  # decode rows only (a one-token last prefill chunk may carry soft embeds)
            seqs = [item.seq for item in scheduled]
            positions = [seq.num_computed_tokens for seq in seqs]
            return self._complete(_Launched(seqs, positions, self.runner.launch_greedy(seqs, positions)))
        sampled, prompt_lp = self.runner.execute(scheduled)
        touched: dict[str, None] = {}
        k = 0
        for i, item in enumerate(scheduled):
            seq = item.seq
            samples = item.samples  # read before num_computed_tokens moves
            if i in prompt_lp:
                # by position: a sequence preempted and prefilled again recomputes rows it already has
                seq.prompt_logprobs[seq.num_computed_tokens:seq.num_computed_tokens + len(prompt_lp[i])] = prompt_lp[i]
                if seq.request_id in self.requests:
                    self.requests[seq.request_id][0].prompt_logprobs = None  # _update rebuilds it
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit_computed(seq)
            if not samples:
                continue
            self._accept(seq, sampled.token_ids[k], sampled.logprobs[k], touched)
            k += 1
        return [self._update(rid) for rid in touched if rid in self.requests]

    def _accept(self, seq: Sequence, tid: int, lps, touched: dict[str, None]) -> None:
        """Append a sampled token to ``seq`` (its K/V row already counted): logprobs, text, stop checks."""
        seq.output_token_ids.append(tid)
        if lps is not None:
            seq.logprobs.append({t: Logprob(lp, rank, self._decode_token(t)) for t, (lp, rank) in lps.items()})
        new_text = ""
        if seq.detokenizer is not None:
            new_text = seq.detokenizer.add(tid)
            seq.text += new_text
        self._finish_check(seq, tid, new_text)
        if seq.finish_reason is not None and seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
            seq.text += seq.detokenizer.flush()  # text held back for an incomplete character
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
        touched[seq.request_id] = None

    def _overlappable(self, seqs: list[Sequence]) -> bool:
        """Whether the sampler would only take the argmax of these sequences' rows with the output tokens
        the host has now, and still with one more: greedy, no penalties, min_tokens already reached, no
        logprobs or prompt logprobs."""
        for seq in seqs:
            p = seq.params
            if (p.temperature != 0.0 or p.logprobs is not None or p.prompt_logprobs is not None
                    or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                    or len(seq.output_token_ids) < p.min_tokens):
                return False
        return True

    def _queue_next(self, launched: _Launched) -> _Launched | None:
        """Queue the decode step after ``launched`` (not read yet) for its sequences that can continue: every
        running sequence is in it, nothing waits for admission, none would stop on max_tokens or the context
        limit with the coming token, all stay overlappable and their next K/V slot can be allocated without
        preemption. None when it cannot be queued."""
        sched = self.scheduler
        if sched.waiting or len(launched.seqs) != len(sched.running):
            return None
        seqs, positions, rows = [], [], []
        for i, (seq, pos) in enumerate(zip(launched.seqs, launched.positions)):
            if seq.is_finished:
                return None
            if self._at_length_limit(seq, coming=1):  # ends with the launched step's token
                continue
            seqs.append(seq)
            positions.append(pos + 1)
            rows.append(i)
        if not seqs or not self._overlappable(seqs):
            return None
        bm = self.block_manager
        if sum(bm.blocks_needed(seq, pos + 1) for seq, pos in zip(seqs, positions)) > bm.num_free_blocks:
            return None
        for seq, pos in zip(seqs, positions):
            bm.allocate(seq, pos + 1)
        feed = launched.picks.tokens
        if len(rows) != len(launched.seqs):
            feed = feed[torch.tensor(rows, device=feed.device)]
        return _Launched(seqs, positions, self.runner.launch_greedy(seqs, positions, feed=feed))

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Queue the next step (``_queue_next``), then read ``launched``'s tokens and append them to the
        sequences still running (a sequence that stopped or was aborted since the launch drops its row)."""
        self._ahead = self._queue_next(launched) if OVERLAP else None
        touched: dict[str, None] = {}
        for seq, tid in zip(launched.seqs, launched.picks.tolist()):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += 1
            self.block_manager.commit_computed(seq)
            self._accept(seq, tid, None, touched)
        if self._ahead is not None and all(seq.is_finished for seq in self._ahead.seqs):
            self._ahead = None  # every sequence stopped: nothing to read
        return [self._update(rid) for rid in touched if rid in self.requests]

    def _update(self, rid: str) -> RequestOutput:
        out, seqs = self.requests[rid]
        for seq, comp in zip(seqs, out.outputs):
            comp.text = seq.text
            # the new tokens only (a sequence's outputs only grow): a step costs O(new), not O(generated)
            comp.token_ids.extend(seq.output_token_ids[len(comp.token_ids):])
            if seq.params.logprobs is not None:
                if comp.logprobs is None:
                    comp.logprobs = []
                comp.logprobs.extend(seq.logprobs[len(comp.logprobs):])
            comp.finish_reason, comp.stop_reason = seq.finish_reason, seq.stop_reason
        first = seqs[0]
        if first.params.prompt_logprobs is not None and out.prompt_logprobs is None:
            # rebuilt only after a step wrote prompt rows (step() clears it then), not on every decode step
            out.prompt_logprobs = [None] + [
                {t: Logprob(lp, rank, self._decode_token(t)) for t, (lp, rank) in d.items()}
                for d in first.prompt_logprobs
            ]
        out.finished = all(s.is_finished for s in seqs)
        if out.finished:
            del self.requests[rid]
        return out
