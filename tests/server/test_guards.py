"""The front end's request checks on a real server (tiny model, byte tokenizer): the API key on every route but
/health, /version and /metrics; Host; Content-Type; the body-size limit (Content-Length and chunked); strict
types and unknown fields; 405 with Allow; no trailing-slash redirect; the character bound before tokenizing;
tokenization off the event loop (/health answers while a 3 MB prompt is tokenized)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from sparrow.server.guards import HttpOptions, host_allowed
from tests.server.conftest import start_server, stop_server

KEY = "sk-guard"
LIMIT = 4 * 2**20  # the default


@pytest.fixture(scope="module")
def guarded(tiny_text_model_dir):
    from sparrow import LLM

    llm = LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32,
              max_num_seqs=4)
    opts = HttpOptions(allowed_hosts=("127.0.0.1", "localhost"))
    running = start_server(llm, served_model_name="tiny", api_key=KEY, http_options=opts)
    yield running
    stop_server(running)


@pytest.fixture
def http(guarded):
    with httpx.Client(base_url=guarded.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


GUARDED_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                  ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"), ("GET", "/openapi.json")]


@pytest.mark.parametrize("method,path", GUARDED_ROUTES)
def test_api_key_on_every_route(guarded, method, path):
    r = httpx.request(method, guarded.url + path, json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.request(method, guarded.url + path, json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.request(method, guarded.url + path, json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code != 401


def test_open_routes(guarded):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(guarded.url + path).status_code == 200, path


def test_host_header(guarded, http):
    assert http.get("/version", headers={"Host": "evil.example"}).status_code == 400
    err = http.get("/v1/models", headers={"Host": "evil.example:8000"}).json()["error"]
    assert "evil.example" in err["message"] and err["code"] == "invalid_host"
    assert http.get("/v1/models", headers={"Host": "localhost:1234"}).status_code == 200
    assert host_allowed("[::1]:80", ("[::1]",)) and host_allowed("x", ("*",)) and not host_allowed("", ("a",))


def test_content_type(http):
    body = b'{"prompt": "x", "max_tokens": 1}'
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = {} if ctype is None else {"content-type": ctype}
        r = http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (ctype, r.text)
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_body_size_limit(http):
    big = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"], r.text[:300]

    def chunked():  # no Content-Length: counted while read
        yield big[:1000]
        for i in range(1000, len(big), 2**20):
            yield big[i:i + 2**20]

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    r = http.post("/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 1})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]  # parsed, then refused


STRICT_CASES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "temperature": "0"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": "1"}, "top_p"),
    ("/detokenize", {"tokens": ["1", "2"]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,field", STRICT_CASES)
def test_strict_types(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and field in err["message"], err


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "temprature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temprature": 0}),
    ("/tokenize", {"prompt": "x", "temprature": 0}),
    ("/detokenize", {"tokens": [1], "temprature": 0}),
])
def test_unknown_field_is_named(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature", r.text
    assert "temprature" in r.json()["error"]["message"]


def test_known_fields_that_change_nothing_pass(http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "metadata": {"a": "b"}, "store": False,
                                           "user": "u", "service_tier": "auto"})
    assert r.status_code == 200, r.text


def test_405_has_allow_and_no_slash_redirect(http):
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    r = http.post("/v1/completions/", json={"prompt": "x"}, headers={"Host": "localhost"})
    assert r.status_code == 404 and "location" not in r.headers, (r.status_code, r.headers)


def test_prompt_rejected_by_characters_before_tokenizing(guarded, http):
    from sparrow.server.guards import prompt_char_limit

    tok = guarded.llm.tokenizer
    limit = prompt_char_limit(tok, 64)
    assert limit is not None and limit >= 64
    text = "ab" * (limit // 2 + 1)
    assert len(tok(text)["input_ids"]) >= 64  # the oracle: the tokenizer says it cannot fit either
    t0 = time.monotonic()
    err = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["error"]
    assert "characters" in err["message"] and err["param"] == "prompt" and time.monotonic() - t0 < 5, err
    err = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}).json()["error"]
    assert "characters" in err["message"] and err["param"] == "messages", err


def test_health_answers_while_a_huge_prompt_is_tokenized(http, guarded):
    """/tokenize counts any length: 3 MB of text takes seconds to tokenize, on a worker thread."""
    done = {}

    def big():
        t0 = time.monotonic()
        done["r"] = http.post("/tokenize", json={"prompt": "a " * 1_500_000})
        done["t"] = time.monotonic() - t0

    th = threading.Thread(target=big)
    th.start()
    time.sleep(0.3)
    worst, polls = 0.0, 0
    with httpx.Client(base_url=guarded.url, timeout=30) as probe:
        while th.is_alive() and polls < 200:
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            worst, polls = max(worst, time.monotonic() - t0), polls + 1
            time.sleep(0.05)
    th.join()
    assert done["r"].status_code == 200 and done["r"].json()["count"] == 3_000_000
    assert done["t"] > 1.0 and polls >= 5, (done["t"], polls)  # the probes ran while it was tokenized
    assert worst < 0.5, worst


def test_allow_unknown_fields_only_logs(tiny_text_model_dir, caplog):
    from sparrow.server.app import build_app
    from sparrow.server.served_model import ServedModel
    from sparrow.server.protocol import CompletionRequest
    from sparrow.tokenizer import load_tokenizer

    class _NoEngine:
        metrics = None

        def attach(self, *a):
            pass

    app = build_app(ServedModel("m", None, 64, 256), load_tokenizer(tiny_text_model_dir), _NoEngine(),
                    options=HttpOptions(reject_unknown_fields=False))
    server = app.state.server
    with caplog.at_level("WARNING"):
        server.check_unknown(CompletionRequest(prompt="x", temprature=0))
    assert "temprature" in caplog.text


def test_metrics_need_api_key_option():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sparrow.server.guards import RequestGuard

    app = FastAPI()
    app.get("/metrics")(lambda: "m")
    app.get("/health")(lambda: "h")
    for need, status in ((True, 401), (False, 200)):
        guarded = RequestGuard(app, KEY, HttpOptions(metrics_need_api_key=need))
        with TestClient(guarded) as c:
            assert c.get("/metrics").status_code == status
            assert c.get("/health").status_code == 200
            assert c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
