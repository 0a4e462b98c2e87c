"""The front end's handle on the engine process (``sparrow.server.engine_loop``): add and abort requests, and
route the engine's per-step messages to each request's asyncio queue.

``EngineClient.add`` sends the request and returns a ``RequestStream`` whose queue receives
(request_id, Update | StreamError | None) items (several requests may share one queue: a completion with several
prompts); None ends the request. The connection is read by a thread of its own (blocking reads of whole
messages, handed to the event loop with one wake-up each): an event loop's reader callback would need the
socket non-blocking (uvloop makes it so), and a Connection read or written on a non-blocking socket can stop
mid-message and desynchronize the stream. The latency metrics are taken on the event loop, when a token reaches
the front end.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

from sparrow.sampling_params import SamplingParams
from sparrow.server.messages import (AbortRequest, AddRequest, Admitted, Baseline, EngineState, LoadLoRA,
                                     LoRAAnswer, StepOutputs, StreamError, UnloadLoRA, Update)
from sparrow.server.metrics import ServerMetrics


@dataclass
class RequestStream:
    request_id: str
    prompt: dict
    params: SamplingParams
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)


class EngineClient:
    """``conn``: the front end's end of the pipe (a multiprocessing Connection); ``metrics`` fed per message."""

    def __init__(self, conn, metrics: ServerMetrics):
        self.conn = conn
        self.metrics = metrics
        self.state: EngineState | None = None
        self._live: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._on_lost = None
        self._lora_ops: dict[int, asyncio.Future] = {}

    def attach(self, loop: asyncio.AbstractEventLoop, on_lost) -> None:
        """Start reading the engine's messages into ``loop``; ``on_lost()`` runs there when the engine stops the
        front end or its process goes away."""
        self._on_lost = on_lost
        threading.Thread(target=self._read, args=(loop,), name="sparrow-engine-reader", daemon=True).start()

    def add(self, prompt: dict, params: SamplingParams, queue: asyncio.Queue | None = None,
            prefix: str = "req", lora_request=None, request_id: str | None = None) -> RequestStream:
        """Send ``prompt`` ({'prompt_token_ids': [...], optional 'prompt'}) to the engine; call on the event loop.
        ``queue``: where its items go (a new queue when None); ``lora_request``: the LoRARequest it runs with
        (None: the base model); ``request_id``: its id (unique among live requests; None: ``prefix-N``)."""
        rid = request_id if request_id is not None else f"{prefix}-{next(self._ids)}"
        s = RequestStream(rid, prompt, params, asyncio.Queue() if queue is None else queue)
        self._live[s.request_id] = s
        self.conn.send(AddRequest(s.request_id, prompt, params, lora_request))
        return s

    async def load_lora(self, lora_request) -> tuple[int, str]:
        """Load a LoRARequest's adapter in the engine (``sparrow.server.lora_updates``) and wait for the answer:
        (HTTP status, message). Call on the event loop (500 when the engine goes away first)."""
        return await self._lora_update(LoadLoRA(next(self._ids), lora_request))

    async def unload_lora(self, lora_int_id: int, lora_name: str) -> tuple[int, str]:
        """Unload an adapter in the engine and wait for the answer, as ``load_lora``."""
        return await self._lora_update(UnloadLoRA(next(self._ids), lora_int_id, lora_name))

    async def _lora_update(self, msg: LoadLoRA | UnloadLoRA) -> tuple[int, str]:
        op = msg.op
        future = self._lora_ops[op] = asyncio.get_running_loop().create_future()
        try:
            self.conn.send(msg)
            return await future
        finally:
            self._lora_ops.pop(op, None)

    def _lora_answer(self, op: int, status: int, message: str) -> None:
        future = self._lora_ops.get(op)
        if future is not None and not future.done():
            future.set_result((status, message))

    def _lora_lost(self) -> None:
        for op in list(self._lora_ops):
            self._lora_answer(op, 500, "the engine went away")

    def abort(self, request_id: str) -> None:
        """Abort a request (finished or unknown ids are ignored)."""
        if self._live.pop(request_id, None) is not None:
            try:
                self.conn.send(AbortRequest(request_id))
            except OSError:
                pass

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                msg = self.conn.recv()
                if isinstance(msg, StepOutputs):
                    loop.call_soon_threadsafe(self._dispatch, msg.items, msg.state)
                elif isinstance(msg, Baseline):
                    loop.call_soon_threadsafe(self.metrics.set_baseline, msg.state)
                elif isinstance(msg, LoRAAnswer):
                    loop.call_soon_threadsafe(self._lora_answer, msg.op, msg.status, msg.message)
                else:
                    break
        except (EOFError, OSError):
            pass
        try:
            loop.call_soon_threadsafe(self._lora_lost)
            loop.call_soon_threadsafe(self._on_lost)
        except RuntimeError:  # the loop closed already
            pass

    def _dispatch(self, items: list, state: EngineState) -> None:
        now = time.monotonic()
        m = self.metrics
        for rid, item in items:
            s = self._live.get(rid)
            if s is None:  # aborted here already
                continue
            if isinstance(item, Admitted):
                m.prompt_tokens.inc(len(s.prompt["prompt_token_ids"]))
                m.queue_time.observe(max(0.0, item.time - s.arrival))
                continue
            if isinstance(item, Update):
                self._count(s, item, now)
            elif item is None:
                del self._live[rid]
                m.e2e.observe(now - s.arrival)
                for reason in s.finish_reasons:
                    m.finished(reason or "abort")
            elif isinstance(item, StreamError):
                del self._live[rid]
            s.queue.put_nowait((rid, item))
        self.state = state
        m.observe_state(state)

    def _count(self, s: RequestStream, update: Update, now: float) -> None:
        m = self.metrics
        n = sum(len(d.token_ids) for d in update.deltas)
        if n:
            if s.first_token is None:
                s.first_token = now
                m.ttft.observe(now - s.arrival)
            else:
                m.itl.observe((now - s.last_token) / n)
            s.last_token = now
            s.num_generated += n
            m.generation_tokens.inc(n)
        if update.finished:
            s.finish_reasons = [d.finish_reason for d in update.deltas]
