"""The HTTP front end's process: uvicorn serving the FastAPI app (``sparrow.server.app``), connected to the
engine process by a pipe. Started by ``sparrow.server.launch`` with the spawn method (safe after CUDA is
initialized in the engine process); it sends ``("ready",)`` once it listens, and exits when the engine's end of
the pipe closes or sends ``("stop",)``.

Why a process of its own: at 64 streams the front end handles one SSE chunk per stream per step (thousands a
second, all Python); in the engine's process it would share one GIL with the engine loop and slow every step.
"""
from __future__ import annotations

import logging


def run_frontend(conn, model, tokenizer, host: str, port: int, api_key: str | None, log_level: int,
                 options=None) -> None:
    """The process's entry: serve ``model`` (a served_model.ServedModel) with ``tokenizer`` (None: token ids only) on
    ``host:port`` until the engine goes away; ``options``: a guards.HttpOptions (None: the defaults). A port that
    cannot be bound ends the process before ready."""
    import uvicorn

    from sparrow.server.app import build_app
    from sparrow.server.engine_client import EngineClient
    from sparrow.server.messages import FrontendReady
    from sparrow.server.metrics import ServerMetrics

    import signal

    # Ctrl-C reaches the whole process group: the engine process stops this one through the pipe (asyncio's own
    # SIGINT handler would raise KeyboardInterrupt here, a traceback and exit code 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("sparrow.server").setLevel(log_level)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                conn.send(FrontendReady())

        def install_signal_handlers(self):  # Ctrl-C reaches the engine process, which stops this one
            pass

    client = EngineClient(conn, ServerMetrics(model.name, model.spec_k, model.max_loras))
    holder: list = []

    def lost():
        holder[0].should_exit = True

    app = build_app(model, tokenizer, client, api_key, on_engine_lost=lost, options=options)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    holder.append(server)
    server.run()
