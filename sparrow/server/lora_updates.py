"""Runtime LoRA in the engine process: the adapters ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add
and remove while the server runs (the front end's side: ``sparrow.server.lora_routes``).

Messages from the front end (``EngineLoop.pump``): ``LoadLoRA`` and ``UnloadLoRA``; each is answered once with a
``LoRAAnswer`` (``sparrow.server.messages``; status 200, or the HTTP status of the error: 400, 404 for a path
with no adapter, 500).

- A load reads and checks the adapter on a thread of its own (``LoRAManager.read``: safetensors, mapping onto the
  model, the slot buffers' widths), so neither the event loop nor the engine's steps wait for the file; the engine
  thread then puts the host copy into the cache between two steps (``LoRAManager.install``); a slot is taken when a
  step first runs it, as for an adapter named at start-up.
- An unload's name is gone from the front end before the message is sent (new requests naming it get 404). The
  engine waits for the requests that run the adapter (running or waiting) to finish, up to
  ``switches.LORA_UNLOAD_TIMEOUT_S`` seconds; the ones left then end with an error naming the unload. Then the
  adapter's host copy goes and its slot is cleared, free for another adapter, and the answer is sent. An id once
  unloaded is refused (``retired``): a request that named the adapter just before the unload but reached the engine
  after it ends with an error instead of reading the folder again.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sparrow import switches
from sparrow.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from sparrow.server.messages import LoadLoRA, LoRAAnswer, UnloadLoRA

log = logging.getLogger(__name__)



@dataclass
class _Unload:
    op: int
    lora_int_id: int
    name: str
    deadline: float
    """time.monotonic() after which the requests still running the adapter are ended."""


class LoRAUpdates:
    """Adapter loads and unloads for an ``EngineLoop``: ``submit`` (the pump thread) queues a message, ``take`` (the
    engine thread, holding ``cond``) takes what is ready, ``apply`` installs loaded adapters and starts unloads
    between steps, ``drain`` (after each step) finishes the unloads whose requests are done or out of time and
    returns their answers.
    ``send(message)``: to the front end; ``cond``: the loop's Condition (held by ``take``, notified when a read
    ends)."""

    def __init__(self, engine, send, cond: threading.Condition):
        self.engine, self.manager = engine, engine.runner.lora
        self._send, self._cond = send, cond
        self._ready: list[tuple] = []
        """Under ``cond``: ("read", op, Adapter | None, status, message) and ("unload", op, id, name) items."""
        self._unloads: list[_Unload] = []
        self.retired: set[int] = set()
        """lora_int_ids being unloaded or unloaded: requests naming them are refused."""

    def submit(self, msg: LoadLoRA | UnloadLoRA) -> None:
        """Queue a front-end message; a load's read starts now, on a thread of its own."""
        if isinstance(msg, LoadLoRA):
            threading.Thread(target=self._read, args=(msg.op, msg.lora_request), name="sparrow-lora-read",
                             daemon=True).start()
            return
        with self._cond:
            self._ready.append(("unload", msg.op, msg.lora_int_id, msg.lora_name))
            self._cond.notify()

    def _read(self, op: int, request) -> None:
        adapter, status, message = None, 200, ""
        t0 = time.monotonic()
        try:
            if self.manager is None:
                raise LoRAAdapterError("this server runs without LoRA (start it with --enable-lora)")
            adapter = self.manager.read(request)
        except LoRAAdapterNotFoundError as e:
            status, message = 404, str(e)
        except LoRAAdapterError as e:
            status, message = 400, str(e)
        except Exception:
            log.exception("reading LoRA adapter %r failed", request.lora_name)
            status, message = 500, f"the LoRA adapter {request.lora_name!r} could not be read (see the server log)"
        if adapter is not None:
            log.info("LoRA adapter %r read from %s in %.2f s (rank %d, %d targets)", request.lora_name,
                     request.lora_path, time.monotonic() - t0, adapter.rank, len(adapter.targets))
        with self._cond:
            self._ready.append(("read", op, adapter, status, message))
            self._cond.notify()

    def ready(self) -> bool:
        """Whether ``take`` has something (call holding ``cond``)."""
        return bool(self._ready)

    def take(self) -> list[tuple]:
        """The items ready now (call holding ``cond``)."""
        items, self._ready = self._ready, []
        return items

    def apply(self, items: list[tuple]) -> None:
        """On the engine thread, between steps: install each read adapter and answer its load; start each unload
        (its id retired from now on)."""
        for item in items:
            if item[0] == "read":
                _, op, adapter, status, message = item
                if adapter is not None:
                    try:
                        self.manager.install(adapter)
                    except LoRAAdapterError as e:
                        status, message = 400, str(e)
                self._send(LoRAAnswer(op, status, message))
            else:
                _, op, lid, name = item
                self.retired.add(lid)
                self._unloads.append(_Unload(op, lid, name, time.monotonic() + switches.LORA_UNLOAD_TIMEOUT_S))

    def drain(self, live: set[str], items: list, error_type) -> list[LoRAAnswer]:
        """Finish the unloads whose adapter no request runs now; past an unload's deadline, end its requests first
        (each gets ``error_type(message, True)`` in ``items`` and leaves ``live``). Returns the answers, to send
        after ``items`` (the front end sees the requests end before the unload's answer)."""
        answers: list[LoRAAnswer] = []
        if not self._unloads:
            return answers
        now, left = time.monotonic(), []
        for u in self._unloads:
            users = [rid for rid, (_, seqs) in self.engine.requests.items()
                     if seqs and seqs[0].lora_int_id == u.lora_int_id]
            if users and now < u.deadline:
                left.append(u)
                continue
            for rid in users:
                self.engine.abort(rid)
                if rid in live:
                    live.discard(rid)
                    items.append((rid, error_type(
                        f"the LoRA adapter {u.name!r} was unloaded (/v1/unload_lora_adapter) before this request "
                        f"finished: it waited {switches.LORA_UNLOAD_TIMEOUT_S:g} s "
                        "(SPARROW_LORA_UNLOAD_TIMEOUT_S)", True)))
            self.manager.remove(u.lora_int_id)
            ended = (f"{len(users)} request(s) still running it after {switches.LORA_UNLOAD_TIMEOUT_S:g} s were "
                     "ended." if users else "")
            log.info("LoRA adapter %r unloaded, its slot free. %s", u.name, ended)
            answers.append(LoRAAnswer(u.op, 200, ended))
        self._unloads = left
        return answers
