"""A real server on 127.0.0.1 at a free port (the engine loop on a thread of the test process, uvicorn in a
front-end process), serving the tiny random Llama with the byte tokenizer (tests/helpers.py): fast enough for
many requests on a 2-core CI machine."""
from __future__ import annotations

import socket

import pytest

from tests.helpers import tiny_model_dir, tiny_text_model_dir  # noqa: F401  (fixtures)

MODEL_NAME = "tiny"
API_KEY = "sk-test"


class RunningServer:
    """A server started by ``sparrow.server.launch.start_server`` in this process (engine loop thread) and a
    front-end process."""

    def __init__(self, proc, llm):
        self.proc, self.llm, self.url = proc, llm, proc.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(llm, **kw) -> RunningServer:
    from sparrow.server.launch import start_server as launch

    return RunningServer(launch(llm, host="127.0.0.1", port=_free_port(), **kw), llm)


def stop_server(running: RunningServer) -> None:
    running.proc.stop()


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
