"""The engine loop: one thread owns the Engine; HTTP handlers (on the asyncio loop) only add, read and abort.

``EngineLoop.add`` queues a request and returns a ``RequestStream`` whose asyncio queue receives one
``Update`` per engine step that advanced the request (a copy of that step's deltas: the engine's RequestOutput
objects are updated in place on the next step, so they are never handed across threads), then ``None``; an
error (the engine refused the request, or a step it was in failed) arrives as a ``StreamError``. The thread
steps while the engine has work and sleeps on a condition variable when idle; adds and aborts are applied
between steps, so an abort frees the request's KV blocks before the next step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from sparrow.errors import SparrowError
from sparrow.outputs import Logprob, RequestOutput
from sparrow.sampling_params import SamplingParams
from sparrow.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """What one step added to one completion."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class Update:
    deltas: list[Delta]
    finished: bool
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class StreamError:
    message: str
    invalid_request: bool
    """True: the request's fault (a 400); False: the engine failed (a 500, no detail leaks)."""


@dataclass
class RequestStream:
    """The handler's side of one request: ``queue`` receives (request_id, Update | StreamError | None) items
    (several requests may share one queue: a completion with several prompts); None ends the request."""

    request_id: str
    prompt: dict
    params: SamplingParams
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)

    def _put(self, item, outbox: list) -> None:
        outbox.append((self, item))


def _put_all(items: list) -> None:
    """On the event loop: hand each (stream, item) to its stream's queue."""
    for stream, item in items:
        stream.queue.put_nowait((stream.request_id, item))


def _send(outbox: list) -> None:
    """Hand the items of one loop iteration over, one wake-up of each event loop (not one per item)."""
    by_loop: dict = {}
    for stream, item in outbox:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop closed (server shutting down)
            pass


def _snapshot(out: RequestOutput) -> Update:
    deltas = []
    for c in out.outputs:
        n = len(c.delta_token_ids)
        lps = c.logprobs[len(c.logprobs) - n:] if c.logprobs is not None else None
        deltas.append(Delta(c.index, c.delta_text, list(c.delta_token_ids), lps, c.finish_reason, c.stop_reason))
    return Update(deltas, out.finished, out.prompt_token_ids,
                  out.prompt_logprobs if out.finished else None)


class EngineLoop:
    """Runs ``engine`` on a daemon thread. ``metrics``: a ServerMetrics fed per output (None: none kept)."""

    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._cond = threading.Condition()
        self._adds: list[RequestStream] = []
        self._aborts: list[str] = []
        self._live: dict[str, RequestStream] = {}
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="sparrow-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def add(self, prompt: dict, params: SamplingParams, queue: asyncio.Queue | None = None,
            prefix: str = "req") -> RequestStream:
        """Queue ``prompt`` ({'prompt_token_ids': [...], optional 'prompt'}); call from the event loop.
        ``queue``: where its items go (a new queue when None)."""
        stream = RequestStream(f"{prefix}-{next(self._ids)}", prompt, params,
                               asyncio.Queue() if queue is None else queue, asyncio.get_running_loop())
        with self._cond:
            self._adds.append(stream)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (finished or unknown ids are ignored); its blocks are freed before the next step."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stop or engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stop:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            outbox: list = []
            for s in adds:
                self._admit(s, outbox)
            for rid in aborts:
                if self._live.pop(rid, None) is not None:
                    engine.abort(rid)
            if engine.has_unfinished_requests():
                self._step(outbox)
            _send(outbox)

    def _step(self, outbox: list) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception:  # the engine aborted the step's requests; every other one goes on
            log.exception("engine step failed")
            failed = StreamError("the engine failed while running this request", False)
            for rid in [r for r in self._live if r not in engine.requests]:
                self._live.pop(rid)._put(failed, outbox)
            return
        now = time.monotonic()
        for out in outputs:
            s = self._live.get(out.request_id)
            if s is not None:
                self._deliver(s, out, now, outbox)
        if self.metrics is not None:
            self.metrics.after_step()

    def _admit(self, s: RequestStream, outbox: list) -> None:
        try:
            self.engine.add_request(s.prompt, s.params, request_id=s.request_id)
        except SparrowError as e:
            s._put(StreamError(str(e), True), outbox)
            return
        except Exception:
            log.exception("adding request %s failed", s.request_id)
            s._put(StreamError("the engine could not take this request", False), outbox)
            return
        self._live[s.request_id] = s
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(s.prompt["prompt_token_ids"]))
            self.metrics.queue_time.observe(time.monotonic() - s.arrival)

    def _deliver(self, s: RequestStream, out: RequestOutput, now: float, outbox: list) -> None:
        update = _snapshot(out)
        n = sum(len(d.token_ids) for d in update.deltas)
        m = self.metrics
        if n:
            if s.first_token is None:
                s.first_token = now
                if m is not None:
                    m.ttft.observe(now - s.arrival)
            elif m is not None:
                m.itl.observe((now - s.last_token) / n)
            s.last_token = now
            s.num_generated += n
            if m is not None:
                m.generation_tokens.inc(n)
        s._put(update, outbox)
        if out.finished:
            del self._live[s.request_id]
            s.finish_reasons = [c.finish_reason for c in out.outputs]
            if m is not None:
                m.e2e.observe(now - s.arrival)
                for reason in s.finish_reasons:
                    m.finished(reason or "abort")
            s._put(None, outbox)
