"""Structured output in the engine: xgrammar grammars compiled off the engine thread, one matcher per sequence,
and the token bitmask applied to a step's logits.

Shapes: R' = sampled rows of the step (plan order), V = the logits' vocabulary (the model's; it may exceed the
tokenizer's: the tokenizer info is built with V entries, tokens past the tokenizer's are never allowed),
W = ceil(V / 32) int32 words of a bitmask row (xgrammar's layout: bit i of word j allows token 32 j + i).

Where compile happens: ``Engine.add_request`` submits the constraint to ``GrammarCompilers`` (one worker thread:
the tokenizer info, built once on first use, then xgrammar's ``GrammarCompiler``), which returns a Future; equal
constraints (``StructuredOutputsParams.cache_key``) share one Future, so a constraint compiles once per engine
(LRU of ``CACHE_SIZE`` grammars and ``CACHE_LIMIT_BYTES``). The engine thread never waits for a compile while other requests can run: the scheduler
leaves a waiting sequence whose grammar is not ready in the queue and admits the ones behind it; only when a step
has nothing to run does the engine wait (at most ``IDLE_WAIT_S``) for a compile to finish. Compiling in the HTTP
front end instead would put it on the event loop's process and would not cover the library (``LLM``).

Where the mask is applied: ``apply_bitmask`` runs in the model runner's sampling stage, on the logits of the
sampled rows right after the forward pass or the CUDA-graph replay (the graphs capture the model and the LM head;
the mask changes every step on the host, so it is filled on the host, copied in one host-to-device transfer and
applied by xgrammar's batched ``apply_token_bitmask_inplace`` to the constrained rows only), before the argmax or
the sampler. Log-probabilities are those of the masked logits, as in vLLM.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from sparrow.errors import InvalidRequestError
from sparrow.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Most compiled grammars kept per engine (least recently used dropped first)."""
CACHE_LIMIT_BYTES = 512 << 20
"""Most bytes of compiled grammars kept per engine (``CompiledGrammar.memory_size_bytes``; vLLM's default xgrammar
cache size)."""
IDLE_WAIT_S = 0.005
"""Longest wait of an engine step with nothing to run for a compile to finish (seconds)."""


class GrammarCompilers:
    """The engine's grammar compiles: a worker thread, the tokenizer info and a cache of compiled grammars.

    ``tokenizer``: a transformers tokenizer (an HF folder's or one built from a GGUF vocabulary); ``vocab_size``:
    the logits' V; ``stop_token_ids``: the engine's EOS ids (the grammar ends by allowing only these).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer, self._vocab_size, self._stop = tokenizer, vocab_size, sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparrow-grammar")
        self._compiler = None  # built on the worker thread by the first compile
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cached here, by key
        return self._compiler

    def _compile(self, key: tuple):
        kind, text, any_ws = key
        compiler = self._get_compiler()
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=any_ws, strict_mode=True)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def submit(self, so: StructuredOutputsParams) -> Future:
        """The Future of ``so``'s compiled grammar (``xgrammar.CompiledGrammar``), shared by equal constraints;
        a compile that failed is dropped from the cache so a later request tries again."""
        key = so.cache_key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            self._evict()
            return fut

    def _evict(self) -> None:
        """Drop the least recently used grammars past CACHE_SIZE or CACHE_LIMIT_BYTES (compiled ones counted; the
        newest entry stays). Requests holding a dropped grammar keep it."""
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        sizes = {k: f.result().memory_size_bytes for k, f in self._cache.items()
                 if f.done() and f.exception() is None}
        total = sum(sizes.values())
        while total > CACHE_LIMIT_BYTES and len(self._cache) > 1:
            key, _ = self._cache.popitem(last=False)
            total -= sizes.get(key, 0)

    def cached(self, so: StructuredOutputsParams) -> bool:
        """Whether ``so``'s grammar is compiled (or compiling) in the cache."""
        with self._lock:
            return so.cache_key in self._cache

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's grammar state: the shared compile Future and, once it is ready, its own GrammarMatcher
    (sequences of one request with n > 1 each have one). Tokens are accepted as the engine appends them; nothing
    is rolled back (preemption recomputes K/V of tokens the matcher already accepted; speculative decoding is
    refused with structured output)."""

    def __init__(self, future: Future):
        self.future = future
        self._matcher = None

    @property
    def done(self) -> bool:
        """The compile finished (successfully or not)."""
        return self.future.done()

    @property
    def ready(self) -> bool:
        """The grammar compiled: the sequence may run (one whose compile failed never does; the engine ends it)."""
        return self.future.done() and self.future.exception() is None

    @property
    def error(self) -> BaseException | None:
        """The compile's exception, once finished."""
        return self.future.exception() if self.future.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.future.result())
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance the matcher by one generated token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()


def wait_any(grammars: list[SequenceGrammar], timeout: float = IDLE_WAIT_S) -> None:
    """Block until one of ``grammars`` finished compiling or ``timeout`` seconds passed."""
    wait([g.future for g in grammars], timeout=timeout, return_when="FIRST_COMPLETED")


def check_supported(params, tokenizer, speculative: bool) -> None:
    """Raise InvalidRequestError when a request's structured_outputs cannot run on this engine: no tokenizer
    (xgrammar needs the token strings), or speculative decoding (draft tokens would need matcher rollback)."""
    if tokenizer is None:
        raise InvalidRequestError("SamplingParams.structured_outputs needs a tokenizer (this engine runs on token "
                                  "ids: skip_tokenizer_init)")
    if speculative:
        raise InvalidRequestError("SamplingParams.structured_outputs cannot be combined with speculative decoding "
                                  "on this engine (start it without speculative_config)")


def constrained_rows(plan) -> list[tuple[int, SequenceGrammar]]:
    """(sampled row, grammar) of each constrained sequence of a plan: one sampled row per sequence (a decode row
    or a prefill's last chunk; verify steps never carry a grammar)."""
    rows, r = [], 0
    for item in plan.seqs:
        grammar = item.seq.grammar
        if grammar is not None and item.num_sampled:
            rows.append((r + item.num_sampled - 1, grammar))
        r += item.num_sampled
    return rows


def apply_bitmask(logits: torch.Tensor, rows: list[tuple[int, SequenceGrammar]]) -> None:
    """Mask, in place, the tokens each constrained row's grammar forbids next.

    logits: [R', V] float (float32 / bf16 / fp16) on any device; rows: (row index, grammar) from
    ``constrained_rows``, each matcher's state the sequence's tokens so far. The bitmask [R', W] int32 is filled
    on the host for the listed rows (``GrammarMatcher.fill_next_token_bitmask``), copied once to the logits'
    device and applied by ``xgrammar.apply_token_bitmask_inplace`` to those rows (forbidden tokens -> -inf); the
    other rows are untouched. Rows are filled one after the other, which on a small CPU is faster than xgrammar's
    threaded BatchGrammarMatcher."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [R', W], all allowed
    for r, grammar in rows:
        grammar.matcher.fill_next_token_bitmask(bitmask, r)
    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[r for r, _ in rows])
