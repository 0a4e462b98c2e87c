"""The OpenAI-compatible server end to end: a real uvicorn server (tests/server/conftest.py) on the tiny random
Llama with a byte tokenizer, driven by the official ``openai`` client (sync and async) and by httpx for raw SSE.

Oracles: ``LLM.generate`` on a second LLM of the same checkpoint (greedy text, token ids and logprobs), the
tokenizer (usage numbers), and invariants (stream == non-stream, same seed -> same samples, no KV block held
after every request ended)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparrow import SamplingParams
from tests.helpers import GEMMA2_STYLE_TEMPLATE
from tests.server.conftest import API_KEY, MODEL_NAME, start_server, stop_server

PROMPTS = ["Hello there", "The quick brown fox", "a", "Once upon a time, in a land"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def oracle(tiny_text_model_dir):
    from sparrow import LLM

    return LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0)


def _greedy(oracle, prompt, max_tokens=16, **kw):
    return oracle.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0]


def _metrics(url) -> dict[str, float]:
    """Samples of /metrics by name (label sets summed)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _wait_idle(srv, timeout=10.0) -> None:
    """Until the engine holds no request and no block (aborts are applied between steps)."""
    engine = srv.llm.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {len(engine.requests)} requests, "
                         f"{engine.block_manager.num_blocks - engine.block_manager.num_free_blocks} blocks held")


def test_models_health_version(tiny_server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "sparrow" and models[0].model_extra["max_model_len"] == 256
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    import sparrow

    assert httpx.get(tiny_server.url + "/version").json() == {"version": sparrow.__version__}


def test_completion_stream_equals_nonstream_equals_generate(client, oracle):
    for prompt in PROMPTS:
        ref = _greedy(oracle, prompt)
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
        assert out.choices[0].text == ref.outputs[0].text
        assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason


def test_completion_prompt_forms(client, oracle):
    ids = oracle.tokenizer("Hello there")["input_ids"]
    ref = _greedy(oracle, "Hello there", 8).outputs[0].text
    for prompt in (["Hello there", "Hello there"], ids, [ids, ids]):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, n=2)
        assert [c.index for c in out.choices] == list(range(len(out.choices)))
        assert all(c.text == ref for c in out.choices)
    echo = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == "Hello there" + ref


def test_return_token_ids(client, oracle):
    """vLLM's return_token_ids: the prompt's ids (the tokenizer's) and the generated ids (LLM.generate's)."""
    ref = _greedy(oracle, "Hello there", 8)
    out = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0].model_extra
    assert out["prompt_token_ids"] == ref.prompt_token_ids and out["token_ids"] == ref.outputs[0].token_ids
    chunks = [c.choices[0].model_extra for c in client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=8, temperature=0, stream=True,
        extra_body={"return_token_ids": True}) if c.choices]
    assert chunks[0]["prompt_token_ids"] == ref.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["token_ids"] for c in chunks), []) == ref.outputs[0].token_ids
    plain = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=2).choices[0]
    assert "token_ids" not in (plain.model_extra or {})


def test_chat_return_token_ids(client, oracle):
    """return_token_ids on chat: the response's prompt_token_ids (the template's ids) and each choice's generated
    ids (LLM.generate's), streamed too (the prompt's in the first chunk)."""
    from sparrow.tokenizer import apply_chat_template

    messages = [{"role": "user", "content": "Hi you"}]
    ref = _greedy(oracle, apply_chat_template(oracle.tokenizer, messages), 8)
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True})
    out = client.chat.completions.create(**kw)
    assert out.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert out.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert sum((c.choices[0].model_extra.get("token_ids", []) for c in chunks[1:]), []) == ref.outputs[0].token_ids


def test_chat_stream_equals_nonstream_and_usage(tiny_server, client, oracle):
    from sparrow.tokenizer import apply_chat_template

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}]
    flat = [messages[0], {"role": "user", "content": "Hi you"}]
    ref = _greedy(oracle, apply_chat_template(oracle.tokenizer, flat), 12)
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    count = httpx.post(tiny_server.url + "/tokenize", json={"messages": flat}, headers=AUTH).json()["count"]
    assert out.usage.prompt_tokens == count == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_raw_sse_framing(tiny_server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", tiny_server.base_url + "/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)


def test_seed_reproducible(client):
    kw = dict(model=MODEL_NAME, prompt="Hello", max_tokens=12, temperature=1.0, n=3, seed=1234)
    a = [c.text for c in client.completions.create(**kw).choices]
    b = [c.text for c in client.completions.create(**kw).choices]
    assert a == b and len(set(a)) > 1  # the seed fixes every sample; the n samples differ


def test_stop_string(client, oracle):
    text = _greedy(oracle, "The quick brown fox", 16).outputs[0].text
    stop = text[5:7]
    cut = text[: text.index(stop)]
    out = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_completion_logprobs_layout(client, oracle):
    ref = _greedy(oracle, "Hello there", 6, logprobs=3).outputs[0]
    lp = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=6, temperature=0,
                                   logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for tid, want, got, top in zip(ref.token_ids, ref.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(want[tid].logprob, abs=1e-5)
        assert 1 <= len(top) <= 3 and max(top.values()) >= got - 1e-6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_prompt_logprobs_max_tokens_zero(client, oracle):
    """lm-eval's log-likelihood request: echo + logprobs + max_tokens 0 -> the prompt's token logprobs."""
    ref = oracle.generate("Hello there", SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    c = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=0, echo=True,
                                  logprobs=1).choices[0]
    assert c.text == "Hello there"
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.tokens) == len(ref.prompt_token_ids)
    for tid, want, got in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], c.logprobs.token_logprobs[1:]):
        assert got == pytest.approx(want[tid].logprob, abs=1e-5)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_streamed_echo_carries_the_prompt_logprobs(client, max_tokens):
    """echo + logprobs streamed: the chunks' logprobs joined equal the non-streamed ones (the prompt's first,
    the first of them null), text offsets counted from the echoed prompt."""
    kw = dict(model=MODEL_NAME, prompt="Hello there", max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    tokens, lps, offsets, text = [], [], [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)


def test_chat_logprobs_layout(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy: the sampled token is the top one
        assert e.bytes == list(e.token.encode())


def test_concurrent_streams_equal_sequential(tiny_server, client):
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(32)]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0)

        async def one(p):
            stream = await aclient.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == alone


def test_cancelled_streams_free_blocks(tiny_server, client):
    before = _metrics(tiny_server.url)

    async def run():
        async with httpx.AsyncClient(base_url=tiny_server.base_url, headers=AUTH, timeout=30) as http:
            async def one(i):
                body = {"model": MODEL_NAME, "prompt": f"cancel me {i}", "max_tokens": 200, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                async with http.stream("POST", "/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return json.loads(line[6:])  # closing the stream here drops the connection
            return await asyncio.gather(*(one(i) for i in range(300)))

    firsts = asyncio.run(run())
    assert all(f["choices"] for f in firsts)
    _wait_idle(tiny_server)
    after = _metrics(tiny_server.url)
    assert after["sparrow:kv_cache_usage_perc"] == 0.0
    # aborted, not run to the end: no request finished, far fewer than 300 x 200 tokens generated
    assert after["sparrow:request_success_total"] == before["sparrow:request_success_total"]
    assert after["sparrow:generation_tokens_total"] - before["sparrow:generation_tokens_total"] < 300 * 200 / 4
    out = client.completions.create(model=MODEL_NAME, prompt="after", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


def test_non_stream_disconnect_aborts(tiny_server, client):
    """A non-stream client that gives up (read timeout: the connection closes) gets its request aborted."""
    before = _metrics(tiny_server.url).get("sparrow:request_success_total", 0)
    body = {"model": MODEL_NAME, "prompt": "slow", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    engine = tiny_server.llm.engine
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=httpx.Timeout(5.0, read=0.05)) as http:
            http.post(tiny_server.base_url + "/completions", json=body, headers=AUTH)
    _wait_idle(tiny_server)
    assert _metrics(tiny_server.url).get("sparrow:request_success_total", 0) == before  # aborted, not finished
    assert not engine.requests
    assert client.completions.create(model=MODEL_NAME, prompt="next", max_tokens=2).usage.completion_tokens == 2


BAD_BODIES = [
    ("completions", {"prompt": "x", "top_k": 10 ** 20}, "top_k"),  # was a 500: the sampler's int64 overflowed
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10 ** 6}, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"prompt": "x", "stop": 5}, "stop"),
    ("completions", {"prompt": [999999]}, "prompt"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3.0]]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "x" * 300}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": {"a": 1}}, "prompt"),
    ("completions", {"prompt": "x", "stream": "yes please"}, "stream"),
    ("completions", {}, "prompt"),
    ("completions", [], None),
    # fields that change the output and that this server does not implement: refused, never ignored
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "logit_bias": {"5": -100}}, "logit_bias"),
    ("completions", {"prompt": "x", "allowed_token_ids": [5]}, "allowed_token_ids"),
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: flags
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),
]


def test_bad_requests_give_4xx_and_server_answers(tiny_server, client):
    with httpx.Client(base_url=tiny_server.base_url, headers=AUTH, timeout=30) as http:
        for path, body, param in BAD_BODIES:
            r = http.post("/" + path, json=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert "Traceback" not in err["message"] and "\n" not in err["message"]
            if param is not None and err["param"] is not None:
                assert err["param"].split(".")[0] == param, (body, err)
            if param is not None:
                assert param in err["message"] or "context length" in err["message"], err
        for raw in (b"{not json", b"", b"\xff\xfe", b'{"prompt": "x", "max_tokens": 1e400}'):
            r = http.post("/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.text)
        assert http.post("/nowhere", json={}).status_code == 404
        assert http.get("/completions").status_code == 405
    _wait_idle(tiny_server)
    assert client.completions.create(model=MODEL_NAME, prompt="still here", max_tokens=3).usage.completion_tokens == 3


def test_error_messages_name_field_and_range(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, headers=AUTH, timeout=30) as http:
        err = http.post("/completions", json={"prompt": "x", "temperature": 9}).json()["error"]
        assert err["param"] == "temperature" and "allowed: [0.0, 2.0]" in err["message"]
        err = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                   "top_p": 0}).json()["error"]
        assert err["param"] == "top_p" and "allowed: (0.0, 1.0]" in err["message"]
        err = http.post("/completions", json={"prompt": "x", "min_tokens": 9, "max_tokens": 2}).json()["error"]
        assert err["param"] == "min_tokens" and "max_tokens" in err["message"]
        err = http.post("/completions", json={"prompt": "x" * 250, "max_tokens": 10}).json()["error"]
        prompt_len = len(tiny_server.llm.tokenizer("x" * 250)["input_ids"])
        assert err["param"] == "max_tokens" and f"{prompt_len} tokens" in err["message"] and "10 more" in err["message"]


def test_engine_error_ends_stream_with_error_event(tiny_server, client):
    """A step that raises (the model runner, here) ends the streams in it with an error event and [DONE]; the
    engine aborted them, and the next request runs normally."""
    runner = tiny_server.llm.engine.runner
    real_run = runner.run

    def failing_run(*a, **kw):
        runner.run = real_run  # once
        raise RuntimeError("injected fault")

    runner.run = failing_run
    try:
        body = {"model": MODEL_NAME, "prompt": "doomed", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", tiny_server.base_url + "/completions", json=body, headers=AUTH) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
    finally:
        runner.run = real_run
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["type"] == "server_error" and "injected" not in err["message"]
    _wait_idle(tiny_server)
    assert client.completions.create(model=MODEL_NAME, prompt="fine", max_tokens=3).usage.completion_tokens == 3


def test_auth_and_unknown_model(tiny_server):
    bad = openai.OpenAI(base_url=tiny_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.post(tiny_server.base_url + "/completions", json={"prompt": "x"}).status_code == 401
    good = openai.OpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        good.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_metrics(tiny_server, client):
    before = _metrics(tiny_server.url)
    out = client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=5, temperature=0)
    after = _metrics(tiny_server.url)
    def grew(name):
        return after[f"sparrow:{name}"] - before.get(f"sparrow:{name}", 0)

    assert grew("prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("generation_tokens_total") == 5
    assert grew("request_success_total") == 1
    assert grew("time_to_first_token_seconds_count") == 1 and grew("e2e_request_latency_seconds_count") == 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "e2e_request_latency_seconds_count", "inter_token_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert "sparrow:" + name in after
    assert "sparrow:lora_requests_info" not in after  # only with LoRA on (tests/server/test_lora_server.py)


def test_template_refusal_is_400(tiny_text_model_dir):
    from sparrow import LLM
    from sparrow.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_text_model_dir)
    tok.chat_template = GEMMA2_STYLE_TEMPLATE
    srv = start_server(LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=128,
                           tokenizer=tok))
    try:
        r = httpx.post(srv.base_url + "/chat/completions",
                       json={"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "System role not supported" in r.json()["error"]["message"]
        ok = httpx.post(srv.base_url + "/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2  # random weights: no EOS
    finally:
        stop_server(srv)


def test_unimplemented_fields_at_their_no_op_values_are_accepted(tiny_server):
    """logit_bias {}, response_format text, tool_choice none and the like change nothing: 200."""
    with httpx.Client(base_url=tiny_server.base_url, headers=AUTH, timeout=30) as http:
        r = http.post("/completions", json={"prompt": "x", "max_tokens": 2, "logit_bias": {}, "best_of": 1,
                                            "metadata": {"k": "v"}})
        assert r.status_code == 200, r.text
        r = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                 "response_format": {"type": "text"}, "tool_choice": "none",
                                                 "add_generation_prompt": True})
        assert r.status_code == 200, r.text


def test_union_field_errors_name_the_accepted_forms(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, headers=AUTH, timeout=30) as http:
        err = http.post("/completions", json={"prompt": 5}).json()["error"]
        assert err["param"] == "prompt" and "list of token ids" in err["message"], err
        err = http.post("/completions", json={"prompt": "x", "stop": 5}).json()["error"]
        assert err["param"] == "stop" and "list of strings" in err["message"], err
        err = http.post("/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}).json()["error"]
        assert err["param"] == "messages.0.content" and "text parts" in err["message"], err
        r = http.post("/completions", content=b'{"prompt": "x", "temperature": NaN}',
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and "NaN" in r.json()["error"]["message"], r.text
