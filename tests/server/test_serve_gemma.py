"""End-to-end checks on the packaged Gemma 3 270M (a real SentencePiece tokenizer with byte-fallback tokens):
served greedy text, streamed and not, equals ``LLM.generate``'s on the same LLM (generated before the server
takes it over), and the ``sparrow serve`` command serves the tiny model from a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from sparrow import SamplingParams
from tests.helpers import REPO_ROOT
from tests.server.conftest import _free_port, start_server, stop_server

PROMPTS = ["The capital of France is", "Write an emoji party: 🎉🥳", "def fib(n):"]


@pytest.fixture(scope="module")
def gemma_server():
    from sparrow import LLM

    llm = LLM(device="cpu", max_model_len=512, num_kv_blocks=64)
    refs = [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    srv = start_server(llm)  # no served name: the packaged model's file name is its id
    yield srv, refs
    stop_server(srv)


def test_gemma_served_text_equals_generate(gemma_server):
    srv, refs = gemma_server
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    assert model == os.path.basename(srv.llm.model_path) and model.endswith(".gguf") and "/" not in model
    for prompt, ref in zip(PROMPTS, refs):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref.text
        assert ref.text == srv.llm.tokenizer.decode(ref.token_ids, skip_special_tokens=True)


def test_serve_command(tiny_text_model_dir):
    port = _free_port()
    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "sparrow", "serve", "--model", str(tiny_text_model_dir),
                             "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--port", str(port),
                             "--served-model-name", "t", "t2", "--api-key", "k"],
                            cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "sparrow serve did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["t", "t2"]  # vLLM: a card per served name
        answer = client.completions.create(model="t2", prompt="hi", max_tokens=3)
        assert answer.usage.completion_tokens == 3 and answer.model == "t"  # any name; the first answers
    finally:
        proc.terminate()  # SIGTERM: the same orderly stop as Ctrl-C, front end included
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-2000:]
    with pytest.raises(httpx.ConnectError):  # the front end's process is gone: nothing listens on the port
        httpx.get(url + "/health", timeout=2)
    assert "KV cache" in out and f"http://127.0.0.1:{port}/v1" in out
    # the access line carries the response's id
    assert f"{answer.id} prompt_tokens=" in out and "generated_tokens=3" in out and "finish=length" in out
