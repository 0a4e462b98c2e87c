"""The engine facade: add_request / step / has_unfinished_requests / abort
(``docs/architecture.md``, "The step pipeline").

Each step runs one StepPlan: the scheduler plans it (rows, sampled rows, blocks, the LoRA adapters' device slots; a
request whose adapter can no longer be read leaves the plan and ends with its error), the model runner runs it
(StepResult: sampled ids on the device, a host copy behind an event), and the engine applies the result: it
appends the accepted tokens, detokenizes incrementally, finishes sequences on EOS, stop token, stop string,
max_tokens or the context limit, and reports each request's RequestOutput (cumulative, plus the delta of the
step; text a stop string may still take back is held back).

Overlapped decode: when the scheduler marks a plan ``queue_next`` (plain greedy decode of every running
sequence), the engine runs the next plan (``Scheduler.schedule_ahead``, fed on the device with this step's ids)
before it reads this step's tokens, so the GPU runs step k + 1 while the host applies step k. A sequence that
stops at step k has its row of step k + 1 computed and dropped. ``step()`` returns each step's outputs once, in
order.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from sparrow.config import TORCH_DTYPES, EngineConfig
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.detokenizer import IncrementalDetokenizer
from sparrow.engine.grammar import GrammarCompilers, SequenceGrammar, check_supported, wait_any
from sparrow.engine.model_runner import ModelRunner, graph_query_lens, kv_bytes_per_token
from sparrow.engine.requests import check_stop, held_back, own_params, parse_prompt
from sparrow.engine.sampler import make_generator
from sparrow.engine.scheduler import Scheduler
from sparrow.engine.sequence import Sequence
from sparrow.engine.speculator import MakeSpeculator
from sparrow.engine.step_plan import StepPlan, StepResult
from sparrow.errors import InvalidRequestError, SparrowError
from sparrow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from sparrow.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer,
                 draft_model: torch.nn.Module | None = None, make_speculator: MakeSpeculator | None = None,
                 workers=None):
        """``draft_model``: the loaded draft of ``config.speculative`` when its method is 'draft_model';
        ``make_speculator``: builds the speculator of ``config.speculative`` (``sparrow.engine.speculator``;
        ``LLM`` passes ``sparrow.spec_decode.make_speculative_decoder``). ``workers``: the tensor-parallel ranks
        1..N-1 (``sparrow.engine.workers.WorkerGroup``) when this process is rank 0 of several; the runner sends
        them every step. Raises InvalidRequestError for a speculative config without make_speculator."""
        self.config = config
        self.tokenizer = tokenizer
        spec = config.speculative
        if spec is not None and make_speculator is None:
            raise InvalidRequestError("speculative_config is set but the engine was given no make_speculator "
                                      "(LLM passes sparrow.spec_decode's)")
        query_lens = graph_query_lens(config)
        cache = config.cache
        draft_bytes = (kv_bytes_per_token(draft_model, TORCH_DTYPES[config.dtype], cache.kv_cache_dtype,
                                          cache.kv_cache_dtype_skip_layers) if draft_model is not None else 0)
        self.runner = ModelRunner(config, model, query_lens, extra_kv_bytes_per_token=draft_bytes, workers=workers)
        self.spec = make_speculator(config, self.runner.num_blocks, draft_model) if spec is not None else None
        """The speculator (``sparrow.engine.speculator.Speculator``) when ``config.speculative`` is set; the
        scheduler drives it, the engine reports each applied step to it (``step_done``)."""
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.max_model_len,
                                   max_loras=config.lora.max_loras if config.lora is not None else None,
                                   lora=self.runner.lora, speculator=self.spec)
        self.requests: dict[str, tuple[RequestOutput, list[Sequence]]] = {}
        self._ids = itertools.count()
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._ahead: tuple[StepPlan, StepResult] | None = None  # the next step, queued before the last was read
        self.last_step_prefill = False
        """Whether the last step computed prompt tokens (a prefill, alone or beside decode rows)."""
        self.grammars: GrammarCompilers | None = None
        """Structured output's grammar compiles (``sparrow.engine.grammar``), made on the first constrained request."""
        self._compiling: dict[str, SequenceGrammar] = {}  # request id -> its grammar, while it compiles
        self.failed: dict[str, SparrowError] = {}
        """Requests the engine ended with an error (request id -> the error): a request whose LoRA adapter's host
        copy was dropped (``max_cpu_loras``) and could not be read again when a step needed it. Whoever reports
        the request's end takes its entry out (``LLM``, the server's engine loop)."""

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    lora_request=None) -> str:
        """Queue a prompt (text or {'prompt_token_ids': [...], optional 'soft_embeds', 'soft_positions'}); returns
        its request id. Raises InvalidRequestError for an empty prompt, one longer than max_model_len, bad token
        ids, a request id in use, or SamplingParams changed after construction into invalid values. The request
        keeps a copy of ``params`` (validated again here), so changing the caller's object later does not touch
        it. ``lora_request``: a LoRARequest to run the request with (the adapter is read and checked here:
        LoRAAdapterError when it cannot be used; InvalidRequestError when the engine runs without enable_lora; if
        its host copy is dropped before a step runs it and its folder cannot be read again then, the request ends
        with the error in ``failed``)."""
        params = own_params(params)
        if params.structured_outputs is not None:
            check_supported(params, self.tokenizer, self.spec is not None)
        if lora_request is not None:
            from sparrow.lora.request import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise InvalidRequestError(f"lora_request must be a LoRARequest or None, got "
                                          f"{type(lora_request).__name__}")
            if self.runner.lora is None:
                raise InvalidRequestError(f"lora_request {lora_request.lora_name!r} given, but the engine was built "
                                          "without LoRA support (LLM(..., enable_lora=True))")
            self.runner.lora.load(lora_request)
        mc = self.config.model
        text, ids, soft, soft_pos = parse_prompt(prompt, self.tokenizer, mc.hidden_size, mc.vocab_size,
                                                 self.config.max_model_len)
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this engine runs on token ids (use stop_token_ids)")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        future = self._grammar_future(params)
        seqs = []
        for i in range(params.n):
            seq = Sequence(rid, i, list(ids), params, self.eos_token_ids, soft_embeds=soft, soft_positions=soft_pos,
                           lora_request=lora_request)
            if params.seed is not None:
                seq.generator = make_generator(params.seed, i, self.runner.device)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            if future is not None:
                seq.grammar = SequenceGrammar(future)
            seqs.append(seq)
        outs = [CompletionOutput(i, "", []) for i in range(params.n)]
        self.requests[rid] = (RequestOutput(rid, text, list(ids), outs, metrics=RequestMetrics(time.time()),
                                            lora_request=lora_request), seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        if future is not None:  # until _check_compiles sees it compiled (or ends it if the compile failed)
            self._compiling[rid] = seqs[0].grammar
        return rid

    def _grammar_future(self, params: SamplingParams):
        """The compile Future of the request's grammar (None without structured_outputs); the compilers (tokenizer
        info, worker thread) are made on the first constrained request."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            self.grammars = GrammarCompilers(self.tokenizer, self.config.model.vocab_size, sorted(self.eos_token_ids))
        return self.grammars.submit(params.structured_outputs)

    def _check_compiles(self, idle: bool) -> None:
        """Requests whose grammar compile finished leave ``_compiling``; one whose compile failed ends with its
        error in ``failed``. ``idle``: the step has nothing to run, so wait (briefly) for a compile."""
        if idle and self._compiling:
            wait_any(list(self._compiling.values()))
        for rid, grammar in list(self._compiling.items()):
            if not grammar.done:
                continue
            del self._compiling[rid]
            if grammar.error is not None and rid in self.requests:
                error = grammar.error
                if not isinstance(error, SparrowError):
                    error = InvalidRequestError(f"the structured_outputs grammar failed to compile: {error}")
                log.warning("request %s failed: %s", rid, error)
                self.failed[rid] = error
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Drop a request, freeing its blocks."""
        _, seqs = self.requests.pop(request_id, (None, []))
        for seq in seqs:
            self._finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the RequestOutput of every request that progressed (``finished`` set on the
        last). If the step raises (an error, or Ctrl-C while the host waits for the GPU), its sequences may be
        half updated (a token sampled but not appended, a step queued ahead of it): every running request is
        aborted before the exception propagates, so the requests left (waiting ones) and later requests run
        normally."""
        try:
            return self._step()
        except BaseException:
            in_flight = {seq.request_id for seq in self.scheduler.running}
            if self._ahead is not None:
                in_flight.update(item.seq.request_id for item in self._ahead[0].seqs)
            self._ahead = None
            for rid in in_flight:
                self.abort(rid)
            raise

    def _step(self) -> list[RequestOutput]:
        if self._ahead is not None:  # queued during the previous call
            (plan, result), self._ahead = self._ahead, None
        else:
            if self._compiling:
                self._check_compiles(idle=False)
            plan = self.scheduler.schedule()
            self._end_failed(plan.failed)
            if not plan.seqs:
                if self._compiling:
                    self._check_compiles(idle=True)
                return []
            result = self.runner.run(plan)
        self.last_step_prefill = any(item.start < item.seq.num_prompt_tokens for item in plan.seqs)
        if plan.queue_next:
            ahead = self.scheduler.schedule_ahead(plan)
            if ahead is not None:
                self._ahead = (ahead, self.runner.run(ahead, previous=result))
        outputs = self._apply(plan, result)
        if self.spec is not None:
            self.spec.step_done(plan)
        if self._ahead is not None and all(item.seq.is_finished for item in self._ahead[0].seqs):
            self._ahead = None  # every sequence stopped: nothing to read
        return outputs

    def _end_failed(self, failed: dict[str, SparrowError]) -> None:
        """End the requests the scheduler took out of a plan (``StepPlan.failed``: an adapter that could not be
        read again), each with its error in ``failed``."""
        for rid, error in failed.items():
            log.warning("request %s failed: %s", rid, error)
            self.failed[rid] = error
            self.abort(rid)

    def _apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result: computed rows and accepted tokens per sequence (a sequence that stopped or was
        aborted after the step was queued drops its rows), prompt logprobs, stop checks; returns the outputs of
        the requests that progressed."""
        token_ids = result.token_ids()
        touched: dict[str, None] = {}
        end = 0
        for i, item in enumerate(plan.seqs):
            seq, first = item.seq, end
            end += item.num_sampled
            if seq.is_finished:
                continue
            if i in result.prompt_logprobs:
                # by position: a sequence preempted and prefilled again recomputes rows it already has
                rows = result.prompt_logprobs[i]
                seq.prompt_logprobs[item.start:item.start + len(rows)] = rows
                if seq.request_id in self.requests:
                    self.requests[seq.request_id][0].prompt_logprobs = None  # _update rebuilds it
            sampled = token_ids[first:end]
            accepted = self.scheduler.commit(item, sampled)  # the drafts the speculator accepts (0 without)
            for j in range(min(accepted + 1, len(sampled))):
                self._append(seq, sampled[j], result.logprobs[first + j] if result.logprobs else None)
                touched[seq.request_id] = None
                if seq.finish_reason is not None:
                    break
        now = time.time()
        return [self._update(rid, now) for rid in touched if rid in self.requests]

    def _decode_token(self, tid: int) -> str | None:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else None

    def _append(self, seq: Sequence, tid: int, lps) -> None:
        """Append a sampled token to ``seq`` (its K/V row already counted): logprobs, text, stop checks. A token
        its grammar refuses (only when min_tokens banned the stop token that was all the grammar allowed) is not
        appended: the sequence ends there with finish_reason "stop"."""
        if seq.grammar is not None and not seq.grammar.accept(tid):
            log.warning("request %s: sampled token %d is outside its grammar (min_tokens banned its end?); the "
                        "sequence ends", seq.request_id, tid)
            seq.finish_reason = "stop"
            if seq.detokenizer is not None:
                seq.text += seq.detokenizer.flush()
            self._finish(seq)
            return
        seq.output_token_ids.append(tid)
        if lps is not None:
            seq.logprobs.append({t: Logprob(lp, rank, self._decode_token(t)) for t, (lp, rank) in lps.items()})
        new_text = ""
        if seq.detokenizer is not None:
            new_text = seq.detokenizer.add(tid)
            seq.text += new_text
        check_stop(seq, tid, new_text, self.config.max_model_len)
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            seq.finish_reason = "stop"  # the grammar is complete (its stop token accepted, ignore_eos or not)
        if seq.finish_reason is not None and seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
            seq.text += seq.detokenizer.flush()  # text held back for an incomplete character
        if seq.finish_reason is not None:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """A sequence ended (or was aborted): its blocks, and its speculator state, are given back."""
        self.scheduler.finish(seq)

    def _update(self, rid: str, now: float) -> RequestOutput:
        """Bring request ``rid``'s RequestOutput up to date: cumulative text and tokens (text a stop string may
        still remove held back), this step's delta (``delta_text``, ``delta_token_ids``) and its metrics
        (``now``: the step's end, time.time())."""
        out, seqs = self.requests[rid]
        if out.metrics.first_token_time is None:
            out.metrics.first_token_time = now
        out.metrics.last_token_time = now
        for seq, comp in zip(seqs, out.outputs):
            visible = max(seq.num_sent_chars, len(seq.text) - held_back(seq))
            comp.text, comp.delta_text = seq.text[:visible], seq.text[seq.num_sent_chars:visible]
            seq.num_sent_chars = visible
            # the new tokens only (a sequence's outputs only grow): a step costs O(new), not O(generated)
            comp.delta_token_ids = seq.output_token_ids[len(comp.token_ids):]
            comp.token_ids.extend(comp.delta_token_ids)
            if seq.params.logprobs is not None:
                if comp.logprobs is None:
                    comp.logprobs = []
                start = len(comp.logprobs)
                comp.logprobs.extend(seq.logprobs[start:])
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + sum(
                    d[t].logprob for t, d in zip(comp.token_ids[start:], comp.logprobs[start:]))
            comp.finish_reason, comp.stop_reason = seq.finish_reason, seq.stop_reason
        first = seqs[0]
        out.num_cached_tokens = first.num_cached_prefix_tokens
        if first.params.prompt_logprobs is not None and out.prompt_logprobs is None:
            # rebuilt only after a step wrote prompt rows (_apply clears it then), not on every decode step
            out.prompt_logprobs = [None] + [
                {t: Logprob(lp, rank, self._decode_token(t)) for t, (lp, rank) in d.items()}
                for d in first.prompt_logprobs
            ]
        out.finished = all(s.is_finished for s in seqs)
        if out.finished:
            out.metrics.finished_time = now
            del self.requests[rid]
        return out
