"""The engine side of the server: one thread owns the Engine and steps it; the HTTP front end (another process,
``sparrow.server.frontend``) talks to it over a pipe, in the messages of ``sparrow.server.messages``.

``EngineLoop.pump`` reads the front end's ``AddRequest``, ``AbortRequest`` and runtime LoRA messages
(``sparrow.server.lora_updates``, each answered with a ``LoRAAnswer``) on a thread of its own and queues them for
the engine thread, which applies them between steps (an abort frees the request's KV blocks before the next step).
After each loop iteration the engine thread sends one ``StepOutputs``: its items are (request_id, item) pairs in
order, where item is ``Admitted`` (the engine took the request), an ``Update`` (a copy of one step's deltas: the
engine's RequestOutput objects are updated in place on the next step), a ``StreamError`` (the engine refused the
request, ended it with its error (``Engine.failed``: its LoRA adapter could not be read again), or a step it was
in failed) or None (the request ended); its ``state`` is an ``EngineState`` snapshot for /metrics. One message per
step, whatever the number of requests, keeps the engine process's share of the serving cost to one pickle per
step; everything per chunk (SSE framing, JSON, HTTP) runs in the front end's process, so it never holds the
engine's GIL.
"""
from __future__ import annotations

import logging
import threading
import time

from sparrow.errors import SparrowError
from sparrow.outputs import RequestOutput
from sparrow.sampling_params import SamplingParams
from sparrow.server.lora_updates import LoRAUpdates
from sparrow.server.messages import (AbortRequest, AddRequest, Admitted, Delta, EngineState, LoadLoRA,
                                     StepOutputs, StreamError, UnloadLoRA, Update)

log = logging.getLogger(__name__)

SLOW_STEP_S = 0.5
"""An engine step longer than this is logged (seconds)."""


def engine_state(engine, step: tuple[str, float] | None = None) -> EngineState:
    sched, bm, spec = engine.scheduler, engine.block_manager, engine.spec
    counts = None
    if spec is not None:
        counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, *spec.num_accepted_tokens_per_pos)
    lora = None
    if engine.runner.lora is not None:
        lora = sched.lora_adapter_names()
    return EngineState(len(sched.running), len(sched.waiting), bm.usage, sched.num_preemptions,
                       bm.prefix_cache_queries, bm.prefix_cache_hits, counts, step, lora)


def watch_kernel_variants(seen: list[str]):
    """Append to ``seen`` the description (kernel name, launch options, argument types) of each Triton kernel
    variant as it is first met in this process, compiled or loaded from Triton's disk cache (the
    ``triton.knobs.runtime.jit_cache_hook``; a hook set before is still called). Returns a callable that removes
    the watch; without triton (or its knobs) nothing is watched."""
    try:
        from triton import knobs
    except ImportError:
        return lambda: None
    old = knobs.runtime.jit_cache_hook

    def hook(**kw):
        seen.append(kw.get("repr", "?"))
        return old(**kw) if old is not None else False

    knobs.runtime.jit_cache_hook = hook

    def undo():
        knobs.runtime.jit_cache_hook = old

    return undo


def _snapshot(out: RequestOutput) -> Update:
    deltas = []
    for c in out.outputs:
        n = len(c.delta_token_ids)
        lps = c.logprobs[len(c.logprobs) - n:] if c.logprobs is not None else None
        deltas.append(Delta(c.index, c.delta_text, list(c.delta_token_ids), lps, c.finish_reason, c.stop_reason))
    # the prompt's logprobs travel once, with the request's first tokens (a streamed echo puts them first)
    first = bool(out.outputs) and all(c.token_ids and len(c.token_ids) == len(c.delta_token_ids)
                                      for c in out.outputs)
    return Update(deltas, out.finished, out.prompt_logprobs if first else None)


class EngineLoop:
    """Runs ``engine`` on a daemon thread; ``send(message)`` carries each iteration's ``StepOutputs`` to
    the front end (called on the engine thread; it must be safe to call from there)."""

    def __init__(self, engine, send):
        self.engine = engine
        self._send = send
        self._cond = threading.Condition()
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()
        self._stop = False
        self._variants: list[str] = []
        self._gone = False
        """The front end is gone (set by ``pump``): the loop ends once it has aborted what was left."""
        self.lora = LoRAUpdates(engine, send, self._cond)
        """Runtime adapter loads and unloads (``sparrow.server.lora_updates``)."""
        self._thread = threading.Thread(target=self._run, name="sparrow-engine-loop", daemon=True)

    def start(self) -> None:
        """Run the loop on a thread of its own (``stop()`` ends it)."""
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until ``stop()`` (from another thread or a signal handler) or the
        front end is gone. On the main thread the engine's steps run as fast as in-process ones; on another thread a
        CPU step is slower (torch gives each thread its own OpenMP pool)."""
        self._run()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def add(self, request_id: str, prompt: dict, params: SamplingParams, lora_request=None) -> None:
        """Queue ``prompt`` ({'prompt_token_ids': [...], optional 'prompt'}) under ``request_id``, with
        ``lora_request`` (a LoRARequest; None: the base model)."""
        with self._cond:
            self._adds.append((request_id, prompt, params, lora_request))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request (finished or unknown ids are ignored); its blocks are freed before the next step."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def pump(self, recv) -> None:
        """Apply the front end's messages (``recv()`` returns the next; EOFError or OSError: the front end is
        gone) until it is gone; then abort what is left."""
        while True:
            try:
                msg = recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, AddRequest):
                self.add(msg.request_id, msg.prompt, msg.params, msg.lora_request)
            elif isinstance(msg, AbortRequest):
                self.abort(msg.request_id)
            elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                self.lora.submit(msg)
        with self._cond:
            self._aborts.extend(self._live)
            self._gone = True
            self._cond.notify()

    def _run(self) -> None:
        unwatch = watch_kernel_variants(self._variants)
        try:
            self._loop()
        finally:
            unwatch()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stop or self._gone or engine.has_unfinished_requests()
                           or self.lora.ready()):
                    self._cond.wait(0.5)  # a timeout: a signal handler of the main thread runs within it
                if self._stop:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                lora_ops = self.lora.take()
            items: list = []
            for rid, prompt, params, lora in adds:
                self._admit(rid, prompt, params, lora, items)
            self.lora.apply(lora_ops)
            for rid in aborts:
                if rid in self._live:
                    self._live.discard(rid)
                    engine.abort(rid)
            step = None
            if engine.has_unfinished_requests():
                step = self._step(items)
            elif self._gone:
                return
            answers = self.lora.drain(self._live, items, StreamError)
            try:
                self._send(StepOutputs(items, engine_state(engine, step)))
                for answer in answers:
                    self._send(answer)
            except (OSError, EOFError):  # the front end is gone: pump() aborts the rest
                pass

    def _step(self, items: list) -> tuple[str, float] | None:
        """One engine step; its outputs go to ``items``. Returns (kind, wall seconds), None when it failed."""
        engine = self.engine
        t0 = time.monotonic()
        seen = len(self._variants)
        try:
            outputs = engine.step()
        except Exception:  # the engine aborted the step's requests; every other one goes on
            log.exception("engine step failed")
            failed = StreamError("the engine failed while running this request", False)
            for rid in [r for r in self._live if r not in engine.requests]:
                self._live.discard(rid)
                items.append((rid, failed))
            return None
        took = time.monotonic() - t0
        if took > SLOW_STEP_S:
            new = self._variants[seen:]
            names = "; ".join(v[:160] for v in new[:4]) + (f"; +{len(new) - 4} more" if len(new) > 4 else "")
            log.info("an engine step took %.2f s (%d running, %d waiting)%s", took, len(engine.scheduler.running),
                     len(engine.scheduler.waiting),
                     f"; Triton kernel variants met first in it: {len(new)} ({names})" if new else "")
        for out in outputs:
            if out.request_id in self._live:
                items.append((out.request_id, _snapshot(out)))
                if out.finished:
                    self._live.discard(out.request_id)
                    items.append((out.request_id, None))
        for rid in list(engine.failed):  # ended by the engine with the request's own error, as _admit reports one
            error = engine.failed.pop(rid)
            if rid in self._live:
                self._live.discard(rid)
                items.append((rid, StreamError(str(error), True)))
        return ("prefill" if engine.last_step_prefill else "decode"), took

    def _admit(self, rid: str, prompt: dict, params: SamplingParams, lora_request, items: list) -> None:
        if lora_request is not None and lora_request.lora_int_id in self.lora.retired:
            items.append((rid, StreamError(f"the model {lora_request.lora_name!r} does not exist (its LoRA adapter "
                                           "was unloaded)", True)))
            return
        try:
            self.engine.add_request(prompt, params, request_id=rid, lora_request=lora_request)
        except SparrowError as e:
            items.append((rid, StreamError(str(e), True)))
            return
        except Exception:
            log.exception("adding request %s failed", rid)
            items.append((rid, StreamError("the engine could not take this request", False)))
            return
        self._live.add(rid)
        items.append((rid, Admitted(time.monotonic())))
