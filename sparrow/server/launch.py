"""Start a server for an ``LLM``: its engine loop on a thread of this process, the HTTP front end in a process
of its own (``sparrow.server.frontend``), a pipe between them. ``sparrow serve`` and the tests use it.

    srv = start_server(llm, port=8000, served_model_name="gemma")   # returns once it listens
    ...
    srv.stop()
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import threading
import time

from sparrow.errors import InvalidRequestError, SparrowError
from sparrow.server.served_model import ServedModel
from sparrow.server.tool_choice import chat_options
from sparrow.server.engine_loop import EngineLoop, engine_state
from sparrow.server.messages import Baseline, FrontendReady, StopFrontend

log = logging.getLogger("sparrow.server")


class ServerProcess:
    """A running server: ``url``, ``model`` (the ServedModel), ``stop()``, ``wait()``."""

    def __init__(self, llm, host: str, port: int, served_model_name, api_key: str | None,
                 startup_timeout: float, warm_up: bool, lora_modules: dict[str, str] | None, background: bool = True,
                 enable_runtime_lora: bool = False, http_options=None, chat: dict | None = None):
        self.llm = llm
        if enable_runtime_lora and llm.config.lora is None:
            raise InvalidRequestError("--enable-runtime-lora needs --enable-lora (LLM(..., enable_lora=True))")
        loras = lora_requests(llm, lora_modules or {})
        self.model = ServedModel.of(llm, served_model_name, loras, runtime_lora=enable_runtime_lora)
        if chat:
            self.model = dataclasses.replace(self.model, **chat_options(**chat))
        clash = [n for n in self.model.names if n in loras]
        if clash:
            raise InvalidRequestError(f"--lora-modules: the adapter name {clash[0]!r} is the base model's "
                                      "served name")
        if warm_up:
            from sparrow.engine.warmup import warm_up as run_warm_up

            t0 = time.monotonic()
            steps = run_warm_up(llm.engine)
            log.info("warm-up: %d steps in %.1f s (kernels compiled for prefill and mixed steps)%s", steps,
                     time.monotonic() - t0, _allocator_state(llm))
        # what startup built (modules, weights, graphs, tokenizer) outlives the server: out of the collector's
        # reach, so that a full collection during a step scans only what requests make
        gc.collect()
        gc.freeze()
        self.url = f"http://{host}:{port}"
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._send_lock = threading.Lock()
        self._proc = ctx.Process(
            target=_frontend_main, name="sparrow-frontend", daemon=True,
            args=(child_conn, self.model, llm.tokenizer, host, port, api_key, log.getEffectiveLevel(), http_options))
        self._proc.start()
        child_conn.close()
        if not self._conn.poll(startup_timeout):
            self._proc.kill()
            raise SparrowError(f"the HTTP front end did not start listening on {host}:{port} within "
                               f"{startup_timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise SparrowError(f"the HTTP front end could not listen on {host}:{port} (is the port in use?); "
                               f"it exited with code {self._proc.exitcode}") from None
        if not isinstance(msg, FrontendReady):
            raise SparrowError(f"the HTTP front end sent {msg!r} instead of ready")
        self.loop = EngineLoop(llm.engine, self._send)
        self._send(Baseline(engine_state(llm.engine)))  # /metrics counts from here (not the warm-up's steps)
        if background:
            self.loop.start()
        self._pump = threading.Thread(target=self.loop.pump, args=(self._conn.recv,), name="sparrow-engine-pump",
                                      daemon=True)
        self._pump.start()

    def serve(self) -> None:
        """Run the engine loop on the calling thread (a server started with ``background=False``) until the
        front end exits or ``stop()``; KeyboardInterrupt (Ctrl-C, or a signal handler raising it) propagates."""
        self.loop.run()

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    @property
    def exitcode(self) -> int | None:
        """The front end's exit code (None while it runs)."""
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the front end exits (or ``timeout`` seconds); True when it has."""
        self._proc.join(timeout)
        return not self._proc.is_alive()

    def stop(self) -> None:
        """Stop the front end (it exits its serve loop), then the engine loop (pending requests are left in the
        engine, aborted by the pump when the pipe closes)."""
        try:
            self._send(StopFrontend())
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._pump.join(10)
        self.loop.stop()
        self._conn.close()
        # back within the collector's reach: frozen objects are never freed, and at exit nanobind (Triton's
        # bindings) reports every one of its objects still alive as "nanobind: leaked ..."
        gc.unfreeze()
        log.info("server stopped%s", _allocator_state(self.llm))


def _allocator_state(llm) -> str:
    """On CUDA, the caching allocator's reserved / allocated GiB, its cudaMalloc and cudaFree calls and its
    retries (a full cache freed to fit an allocation: a synchronizing stall) so far, for the log; else ''."""
    if not llm.config.device.startswith("cuda"):
        return ""
    import torch

    m = torch.cuda.memory_stats()
    return (f"; CUDA allocator: {m.get('reserved_bytes.all.current', 0) / 2**30:.1f} GiB reserved, "
            f"{m.get('allocated_bytes.all.current', 0) / 2**30:.1f} GiB allocated, {m.get('num_device_alloc', 0)} "
            f"cudaMalloc / {m.get('num_device_free', 0)} cudaFree calls, {m.get('num_alloc_retries', 0)} retries")


def _frontend_main(*args) -> None:
    from sparrow.server.frontend import run_frontend

    run_frontend(*args)


def lora_requests(llm, lora_modules: dict[str, str]) -> dict:
    """name -> LoRARequest (ids 1, 2, .. in order) for ``lora_modules`` (name -> PEFT folder), each adapter read
    and checked now. Raises InvalidRequestError when the LLM was built without enable_lora, LoRAAdapterError
    for an adapter it cannot use."""
    if not lora_modules:
        return {}
    if llm.config.lora is None:
        raise InvalidRequestError("--lora-modules needs --enable-lora (LLM(..., enable_lora=True))")
    from sparrow.lora.request import LoRARequest

    out = {}
    for i, (name, path) in enumerate(lora_modules.items(), start=1):
        req = out[name] = LoRARequest(name, i, path)
        llm.engine.runner.lora.load(req)
    return out


def start_server(llm, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | list[str] | None = None,
                 api_key: str | None = None, startup_timeout: float = 120.0, warm_up: bool | None = None,
                 lora_modules: dict[str, str] | None = None, background: bool = True,
                 enable_runtime_lora: bool = False, http_options=None, chat: dict | None = None) -> ServerProcess:
    """Serve ``llm`` (its engine is the server's from now until ``stop()``: do not call the LLM meanwhile) on
    ``host:port``; returns once the front end listens. ``warm_up``: run ``sparrow.engine.warmup.warm_up`` first
    (None: when the engine runs on CUDA, where kernels compile on first use). ``lora_modules``: name -> PEFT
    adapter folder, each served as a model of that name (the request's ``model`` picks it; needs
    ``enable_lora``). Raises SparrowError when an adapter cannot be used, when it cannot listen (the port in
    use) or when the front end does not start within ``startup_timeout`` seconds. ``background``: the engine
    loop runs on a thread of its own; False: the caller runs it with ``serve()`` (``sparrow serve`` does, on
    the main thread, where steps run at in-process speed). ``served_model_name``: a name or several (vLLM's: the
    first is the id responses and /v1/models report, a request's ``model`` may give any); None: the model's folder
    or file name (``served_model.model_id``). ``enable_runtime_lora``: serve /v1/load_lora_adapter and
    /v1/unload_lora_adapter (``sparrow.server.lora_routes``; needs ``enable_lora``). ``http_options``: the
    front end's request checks (``sparrow.server.guards.HttpOptions``: body size, allowed hosts, /metrics and the
    key, unknown fields). ``chat``: tool calling and reasoning options, ``tool_choice.chat_options``'s
    arguments (``{"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}``)."""
    if warm_up is None:
        warm_up = llm.config.device.startswith("cuda")
    return ServerProcess(llm, host, port, served_model_name, api_key, startup_timeout, warm_up, lora_modules,
                         background, enable_runtime_lora, http_options, chat)
