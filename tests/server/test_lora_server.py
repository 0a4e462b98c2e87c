"""Two LoRA adapters served beside the base model (``start_server(..., lora_modules=...)``, ``sparrow serve
--enable-lora --lora-modules``): /v1/models lists them, the request's ``model`` picks one (and is the response's
``model``), and each answers as ``LLM.generate`` with that adapter's LoRARequest (sparrow's LoRA itself is checked
against PEFT in tests/lora); /metrics' lora_requests_info names the adapters of the running and waiting requests."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparrow import LoRARequest, SamplingParams
from tests.helpers import assert_cli_error, make_llm, run_cli
from tests.lora._adapters import DENSE_TARGETS, base_model, make_adapter
from tests.server.conftest import start_server, stop_server

PROMPTS = [[5, 6, 7, 8, 9], [40, 2, 33]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = base_model("llama", root / "base")
    return base, {name: make_adapter("llama", base, root / name, seed=i, r=4, lora_alpha=8,
                                     target_modules=DENSE_TARGETS) for i, name in enumerate(("a", "b"), start=1)}


def test_adapters_are_models_picked_by_name(folders):
    base, adapters = folders
    llm = make_llm(base, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expect = {None: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                 params)]}
    for i, (name, path) in enumerate(adapters.items(), start=1):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            lora_request=LoRARequest(name, i, str(path)))
        expect[name] = [o.outputs[0].token_ids for o in outs]
    assert expect["a"] != expect[None] and expect["b"] != expect[None] and expect["a"] != expect["b"]
    srv = start_server(llm, served_model_name="base", lora_modules={k: str(v) for k, v in adapters.items()})
    try:
        models = httpx.get(srv.base_url + "/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("a", "base"), ("b", "base")]
        assert models[1]["root"] == str(adapters["a"])
        for name in (None, "base", "a", "b"):
            body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            if name is not None:
                body["model"] = name
            got = httpx.post(srv.base_url + "/completions", json=body, timeout=60).json()
            ids = [c["token_ids"] for c in sorted(got["choices"], key=lambda c: c["index"])]
            assert ids == expect[None if name == "base" else name], name
            assert got["model"] == (name or "base")  # the response names the model that answered
        with httpx.stream("POST", srv.base_url + "/completions", timeout=60, json={
                "model": "b", "prompt": PROMPTS[0], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 2 and all(c["model"] == "b" for c in chunks)
        err = httpx.post(srv.base_url + "/completions", json={"model": "c", "prompt": PROMPTS[0]}, timeout=30)
        assert err.status_code == 404 and "'base', 'a', 'b'" in err.json()["error"]["message"]
    finally:
        stop_server(srv)


def _lora_info(url) -> list[tuple[dict, float]]:
    """The series of /metrics' sparrow:lora_requests_info: (labels, value)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            if fam.name == "sparrow:lora_requests_info" for s in fam.samples]


def _wait_lora_info(url, running: str, waiting: str, timeout: float = 20.0) -> float:
    """Poll /metrics until lora_requests_info is one series labelled ``running`` / ``waiting`` (max_lora 1); returns
    its value."""
    want = {"running_lora_adapters": running, "waiting_lora_adapters": waiting, "max_lora": "1"}
    deadline = time.monotonic() + timeout
    while True:
        series = _lora_info(url)
        if [labels for labels, _ in series] == [want]:
            return series[0][1]
        assert time.monotonic() < deadline, f"lora_requests_info is {series}, waited for {want}"
        time.sleep(0.01)


def test_lora_requests_info_names_running_and_waiting_adapters(folders, monkeypatch):
    """vLLM's lora_requests_info: with max_loras=1, a request of adapter b sent while one of a runs waits (labels
    running 'a', waiting 'b'), then runs alone ('b', ''); idle: ('', ''). One series, its value the wall-clock time
    it was last set; base-model requests take no adapter and are not named."""
    base, adapters = folders
    llm = make_llm(base, max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8)
    step = llm.engine.step

    def slow_step():  # a tiny-model step takes ~1 ms: slowed so that /metrics sees each state while it lasts
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    srv = start_server(llm, served_model_name="base", lora_modules={k: str(v) for k, v in adapters.items()})
    done: dict = {}

    def post(model, max_tokens):
        body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if model is not None:
            body["model"] = model
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=60)
        done[model] = (r.status_code, r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=post, args=args) for args in (("a", 150), (None, 150), ("b", 40))]
    try:
        t0 = time.time()
        assert t0 - 60 < _wait_lora_info(srv.url, "", "") <= time.time()  # shown from the start
        threads[0].start()
        _wait_lora_info(srv.url, "a", "")
        threads[1].start()  # the base model beside a: no adapter to name
        threads[2].start()
        t1 = time.time()
        assert t1 <= _wait_lora_info(srv.url, "a", "b") <= time.time()  # set again with each engine step
        _wait_lora_info(srv.url, "b", "")
        for t in threads:
            t.join(60)
        assert done == {"a": (200, 150), None: (200, 150), "b": (200, 40)}
        assert _wait_lora_info(srv.url, "", "") >= t1
    finally:
        stop_server(srv)


def test_lora_modules_need_enable_lora_and_a_name(folders):
    base, adapters = folders
    assert_cli_error(run_cli("serve", "--model", str(base), "--device", "cpu", "--lora-modules",
                             f"a={adapters['a']}"), "--lora-modules needs --enable-lora")
    assert_cli_error(run_cli("serve", "--model", str(base), "--device", "cpu", "--enable-lora", "--lora-modules",
                             "nameless"), "expected NAME=PATH")
