"""``sparrow serve --model-shape``: a random-weight model without a tokenizer, served on token ids.

Oracle: ``LLM.generate`` on a second ``random_llm`` of the same shape and seed (the same weights): greedy
token ids and logprobs; a tokenizer-less request the server cannot answer (chat, text prompt, /tokenize, stop
strings) is a 400 naming the missing tokenizer."""
from __future__ import annotations

import json

import httpx
import pytest

from sparrow import SamplingParams
from tests.server.conftest import start_server, stop_server

SHAPE = "tiny-dense"
PROMPTS = [[5, 17, 300, 42], [1, 2, 3], [511, 0, 7, 7, 7, 100]]


def _llm():
    from sparrow.model_shapes import random_llm

    return random_llm(SHAPE, device="cpu", dtype="float32", seed=3, max_model_len=64, num_kv_blocks=32,
                      max_num_seqs=8)


@pytest.fixture(scope="module")
def shape_server():
    running = start_server(_llm(), served_model_name=SHAPE)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def oracle():
    return _llm()


def test_token_id_prompts_answer_token_ids(shape_server, oracle):
    refs = oracle.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
    with httpx.Client(base_url=shape_server.base_url, timeout=30) as http:
        assert http.get("/models").json()["data"][0]["id"] == SHAPE
        body = {"model": SHAPE, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": 2}
        out = http.post("/completions", json=body).json()
        for c, p, ref in zip(out["choices"], PROMPTS, refs):
            want = ref.outputs[0].token_ids
            assert c["text"] == "" and c["prompt_token_ids"] == p and c["token_ids"] == want
            assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
            assert c["logprobs"]["token_logprobs"] == pytest.approx(
                [lp[t].logprob for t, lp in zip(want, ref.outputs[0].logprobs)], abs=1e-4)
        assert out["usage"]["completion_tokens"] == 6 * len(PROMPTS)
        streamed, first = [], None
        with http.stream("POST", "/completions", json={**body, "prompt": PROMPTS[0], "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    first = first or choice
                    streamed += choice["token_ids"]
        assert first["prompt_token_ids"] == PROMPTS[0] and streamed == refs[0].outputs[0].token_ids


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": "text", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": ["x"]}, "stop"),
    ("/tokenize", {"prompt": "text"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_text_requests_are_400_naming_the_tokenizer(shape_server, path, body, param):
    r = httpx.post(shape_server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "tokenizer" in err["message"] and err["param"] == param, err
    assert httpx.post(shape_server.base_url + "/completions", json={"prompt": [3], "max_tokens": 1},
                      timeout=30).json()["choices"][0]["token_ids"]
