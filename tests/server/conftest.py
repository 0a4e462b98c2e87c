"""A real uvicorn server on 127.0.0.1 at a free port, in a thread of the test process, serving the tiny random
Llama with the byte tokenizer (tests/helpers.py): fast enough for many requests on a 2-core CI machine."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.helpers import tiny_model_dir, tiny_text_model_dir  # noqa: F401  (fixtures)

MODEL_NAME = "tiny"
API_KEY = "sk-test"


@dataclass
class RunningServer:
    url: str
    llm: object
    app: object
    server: object

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(llm, **app_kw) -> RunningServer:
    import uvicorn

    from sparrow.server.app import build_app

    app = build_app(llm, **app_kw)
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("the test server did not start")
    running = RunningServer(url, llm, app, server)
    running.thread = thread
    return running


def stop_server(running: RunningServer) -> None:
    running.server.should_exit = True
    running.thread.join(timeout=10)


@pytest.fixture(scope="session")
def tiny_llm(tiny_text_model_dir):  # noqa: F811
    from sparrow import LLM

    return LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=128,
               block_size=16, max_num_seqs=64)


@pytest.fixture(scope="session")
def tiny_server(tiny_llm):
    """The tiny model served as MODEL_NAME with API_KEY. Tests must not call ``tiny_llm`` while it runs, except
    through ``offline``."""
    running = start_server(tiny_llm, served_model_name=MODEL_NAME, api_key=API_KEY)
    yield running
    stop_server(running)
