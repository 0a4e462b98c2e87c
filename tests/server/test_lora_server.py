"""Two LoRA adapters served beside the base model (``start_server(..., lora_modules=...)``, ``sparrow serve
--enable-lora --lora-modules``): /v1/models lists them, the request's ``model`` picks one (and is the response's
``model``), and each answers as ``LLM.generate`` with that adapter's LoRARequest (sparrow's LoRA itself is checked
against PEFT in tests/lora)."""
from __future__ import annotations

import json

import httpx
import pytest

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


def test_lora_modules_need_enable_lora_and_a_name(folders):
    base, adapters = folders
    assert_cli_error(run_cli("serve", "--model", str(base), "--device", "cpu", "--lora-modules",
                             f"a={adapters['a']}"), "--lora-modules needs --enable-lora")
    assert_cli_error(run_cli("serve", "--model", str(base), "--device", "cpu", "--enable-lora", "--lora-modules",
                             "nameless"), "expected NAME=PATH")
