"""Runtime LoRA (``start_server(..., enable_runtime_lora=True)``, ``sparrow serve --enable-lora
--enable-runtime-lora``): POST /v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's bodies and answers; a
loaded adapter is listed in /v1/models with ``parent`` the base model's id and answers requests naming it; an
unloaded one is listed no more and a request naming it gets 404 ``model_not_found``; its slot is free for another
adapter (the server has one slot); an unload waits for the requests that run the adapter, up to
SPARROW_LORA_UNLOAD_TIMEOUT_S, then ends them with an error. --served-model-name takes several names.

Oracles: PEFT's greedy tokens (transformers fp32 on the same base and adapter folders), compared up to the first
near-tie; the official ``openai`` client for every request, whose error classes give the HTTP status."""
from __future__ import annotations

import shutil
import threading
import time
import types

import openai
import pytest
from safetensors.torch import load_file, save_file

from sparrow import switches
from sparrow.errors import InvalidRequestError
from tests.helpers import assert_cli_error, make_llm, run_cli
from tests.lora._adapters import DENSE_TARGETS, base_model, make_adapter, peft_greedy
from tests.models._hf_tiny import compare
from tests.server.conftest import API_KEY, start_server, stop_server

PROMPT = [5, 6, 7, 8, 9, 10]
N = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-lora")
    base = base_model("llama", root / "base")
    out = {"base": base,
           "a": make_adapter("llama", base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=DENSE_TARGETS),
           "b": make_adapter("llama", base, root / "b", seed=2, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
           "r16": make_adapter("llama", base, root / "r16", seed=3, r=16, target_modules=["v_proj"])}
    lacking = out["lacking"] = root / "lacking"  # a's folder with one module the model does not have
    shutil.copytree(out["a"], lacking)
    file = lacking / "adapter_model.safetensors"
    save_file({k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.x_proj"): v
               for k, v in load_file(str(file)).items()}, str(file))
    return out


@pytest.fixture(scope="module")
def peft(folders):
    """name -> PEFT's (greedy ids, logits) of PROMPT (None: the base model)."""
    return {name: peft_greedy("llama", folders["base"], folders[name] if name else None, PROMPT, N)
            for name in (None, "a", "b")}


@pytest.fixture(scope="module")
def server(folders):
    llm = make_llm(folders["base"], max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8)
    srv = start_server(llm, served_model_name=["base", "alias"], enable_runtime_lora=True,
                       lora_modules={"s": str(folders["b"])})  # an adapter given at start-up, lora_int_id 1
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _load(client, name, path) -> str:
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)}, cast_to=str)


def _unload(client, name) -> str:
    return client.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=str)


def _models(client) -> list[tuple[str, str | None]]:
    return [(m.id, m.model_extra["parent"]) for m in client.models.list().data]


def _complete(client, model, max_tokens=N, **kw):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def _assert_peft(out, want) -> None:
    ids = out.choices[0].model_extra["token_ids"]
    assert compare(*want, types.SimpleNamespace(token_ids=ids, logprobs=None)) >= N // 2, (ids, want[0])


def _slots(server) -> dict:
    lora = server.llm.engine.runner.lora
    return {"slots": dict(lora.slots), "cached": set(lora.adapters), "ids": set(lora.folders)}


def test_load_list_generate_unload(server, client, folders, peft):
    assert _models(client) == [("base", None), ("alias", None), ("s", "base")]
    assert _load(client, "a", folders["a"]) == "Success: LoRA adapter 'a' added successfully."
    cards = {m.id: m for m in client.models.list().data}
    assert _models(client) == [("base", None), ("alias", None), ("s", "base"), ("a", "base")]
    assert cards["a"].model_extra["root"] == str(folders["a"]) and cards["a"].owned_by == "sparrow"
    assert cards["a"].object == "model" and cards["a"].model_extra["max_model_len"] == 256
    out = _complete(client, "a")
    assert out.model == "a"
    _assert_peft(out, peft["a"])
    base = _complete(client, "alias")  # any served name; the response names the first
    assert base.model == "base"
    _assert_peft(base, peft[None])
    _assert_peft(_complete(client, "s"), peft["b"])  # the start-up adapter beside the runtime one (ids apart)
    assert _unload(client, "s") == "Success: LoRA adapter 's' removed successfully."  # start-up ones unload too
    assert _unload(client, "a") == "Success: LoRA adapter 'a' removed successfully."
    assert _models(client) == [("base", None), ("alias", None)]
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "a")
    assert err.value.code == "model_not_found"
    assert _slots(server) == {"slots": {}, "cached": set(), "ids": set()}  # host copy and slot gone
    # the one slot takes another adapter, and a name can be loaded again
    _load(client, "b", folders["b"])
    _assert_peft(_complete(client, "b"), peft["b"])
    _unload(client, "b")
    _load(client, "a", folders["a"])
    _assert_peft(_complete(client, "a"), peft["a"])
    _unload(client, "a")
    assert _slots(server)["slots"] == {}


@pytest.mark.parametrize("body,status,match", [
    ({"lora_name": "x", "lora_path": "/nowhere/adapter"}, 404, "/nowhere/adapter is not a folder"),
    ({"lora_name": "x", "lora_path": "{base}"}, 404, "adapter_config.json does not exist"),
    ({"lora_name": "x", "lora_path": "{r16}"}, 400, r"rank 16 of '.*v_proj' exceeds max_lora_rank=8"),
    ({"lora_name": "x", "lora_path": "{lacking}"}, 400, r"'model.layers.0.self_attn.x_proj' does not exist in the "
                                                        "model"),
    ({"lora_name": "alias", "lora_path": "{a}"}, 400, "'alias' is the base model's served name"),
    ({"lora_name": "", "lora_path": "{a}"}, 400, "Both 'lora_name' and 'lora_path' must be provided"),
    ({"lora_name": "x"}, 400, "lora_path"),
    ({"lora_name": 5, "lora_path": "{a}"}, 400, "lora_name"),
    ({"lora_name": "x", "lora_path": "{a}", "load_inplace": "yes"}, 400, "load_inplace"),
    ({"lora_name": "x", "lora_path": "{a}", "lora_pth": "{a}"}, 400, "lora_pth: unknown field"),
])
def test_load_errors(client, folders, body, status, match):
    body = {k: v.format(**folders) if isinstance(v, str) else v for k, v in body.items()}
    with pytest.raises(openai.APIStatusError, match=match) as err:
        client.post("/load_lora_adapter", body=body, cast_to=str)
    assert err.value.status_code == status
    assert "x" not in {m for m, _ in _models(client)} and "alias" in {m for m, _ in _models(client)}


def test_duplicate_and_unknown_names(client, folders, peft):
    _load(client, "a", folders["a"])
    with pytest.raises(openai.BadRequestError, match="The lora adapter 'a' has already been loaded"):
        _load(client, "a", folders["b"])
    with pytest.raises(openai.NotFoundError, match="The lora adapter 'c' cannot be found"):
        _unload(client, "c")
    with pytest.raises(openai.NotFoundError, match="cannot be found"):  # vLLM's lora_int_id must match
        client.post("/unload_lora_adapter", body={"lora_name": "a", "lora_int_id": 999}, cast_to=str)
    _assert_peft(_complete(client, "a"), peft["a"])  # still served
    _unload(client, "a")
    with pytest.raises(openai.NotFoundError):
        _unload(client, "a")


def _slow_steps(monkeypatch, llm, seconds=0.01):
    step = llm.engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow)


def _stream_in_thread(client, model, max_tokens, result: dict) -> threading.Thread:
    def run():
        try:
            chunks = list(_complete(client, model, max_tokens, stream=True))
            result["tokens"] = sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks if c.choices)
            result["finish"] = chunks[-1].choices[0].finish_reason
        except openai.APIError as e:
            result["error"] = str(e)
        result["end"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_running(server, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(s.num_tokens > s.num_prompt_tokens for s in list(server.llm.engine.scheduler.running)):
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.005)


def test_unload_waits_for_running_requests(server, client, folders, monkeypatch):
    """The name is gone at once (404 for a new request while the unload waits); the answer comes after the
    request that ran the adapter finished, whole; then the slot is free."""
    _slow_steps(monkeypatch, server.llm)
    lora, engine = server.llm.engine.runner.lora, server.llm.engine
    removed = []
    remove = lora.remove
    monkeypatch.setattr(lora, "remove", lambda lid: (removed.append(dict(engine.requests)), remove(lid))[1])
    _load(client, "a", folders["a"])
    result: dict = {}
    t = _stream_in_thread(client, "a", 80, result)
    _wait_running(server)
    unload: dict = {}
    u = threading.Thread(target=lambda: unload.update(text=_unload(client, "a"), end=time.monotonic()))
    u.start()
    deadline = time.monotonic() + 10
    while ("a", "base") in _models(client):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a", 2)
    assert u.is_alive()  # still waiting for the stream
    t.join(60)
    u.join(60)
    assert result == {"tokens": 80, "finish": "length", "end": result["end"]}
    assert unload["text"] == "Success: LoRA adapter 'a' removed successfully."
    assert removed == [{}]  # the adapter went once no request ran it
    assert _slots(server)["slots"] == {}


def test_unload_ends_requests_still_running_after_the_timeout(server, client, folders, monkeypatch):
    _slow_steps(monkeypatch, server.llm, 0.02)
    monkeypatch.setattr(switches, "LORA_UNLOAD_TIMEOUT_S", 0.3)
    _load(client, "a", folders["a"])
    result: dict = {}
    t = _stream_in_thread(client, "a", 200, result)
    _wait_running(server)
    t0 = time.monotonic()
    text = _unload(client, "a")
    assert 0.3 <= time.monotonic() - t0 < 3
    assert text == ("Success: LoRA adapter 'a' removed successfully. 1 request(s) still running it after 0.3 s "
                    "were ended.")
    t.join(30)
    assert "the LoRA adapter 'a' was unloaded (/v1/unload_lora_adapter) before this request finished" in \
        result["error"]
    assert _slots(server) == {"slots": {}, "cached": set(), "ids": set()}
    assert not server.llm.engine.requests


def test_runtime_lora_needs_the_flag_and_enable_lora(tiny_server, folders):
    import httpx

    r = httpx.post(tiny_server.base_url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404  # not served without enable_runtime_lora, as vLLM without its variable
    plain = make_llm(folders["base"], max_model_len=64)
    with pytest.raises(InvalidRequestError, match="--enable-runtime-lora needs --enable-lora"):
        start_server(plain, enable_runtime_lora=True)
    assert_cli_error(run_cli("serve", "--model", str(folders["base"]), "--device", "cpu", "--enable-runtime-lora"),
                     "--enable-runtime-lora needs --enable-lora")


def test_model_ids_are_names_never_paths():
    from sparrow.server.served_model import model_id, served_names

    assert model_id("/models/SmolLM2-135M-Instruct/") == "SmolLM2-135M-Instruct"
    assert model_id("/a/b/gemma-3-270m-Q4_K_M.gguf") == "gemma-3-270m-Q4_K_M.gguf"
    assert model_id("relative/dir") == "dir" and model_id(None) == "sparrow-model"
    assert served_names(None, "/a/b/m.gguf") == ("m.gguf",)
    assert served_names("x", "/a") == ("x",) and served_names(["x", "y"], None) == ("x", "y")
    for bad, match in (([], "one or more non-empty names"), (["x", ""], "non-empty"), (["x", "x"], "each name once")):
        with pytest.raises(InvalidRequestError, match=match):
            served_names(bad, None)


def test_engine_refuses_a_request_reaching_it_after_the_unload(folders):
    """The engine's side alone (``EngineLoop`` with its messages recorded): a request that named the adapter before
    the unload but reaches the engine after it ends with an error (it does not read the folder again); the unload's
    answer follows the end of the request that ran the adapter."""
    from sparrow import LoRARequest, SamplingParams
    from sparrow.server.engine_loop import EngineLoop
    from sparrow.server.messages import LoadLoRA, LoRAAnswer, StepOutputs, StreamError, UnloadLoRA, Update

    llm = make_llm(folders["base"], max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8)
    sent: list = []
    loop = EngineLoop(llm.engine, sent.append)
    loop.start()

    def wait(pred, what):
        deadline = time.monotonic() + 20
        while not pred():
            assert time.monotonic() < deadline, f"waited for {what}; sent {sent}"
            time.sleep(0.005)

    try:
        req = LoRARequest("a", 5, str(folders["a"]))
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        loop.lora.submit(LoadLoRA(1, req))
        wait(lambda: LoRAAnswer(1, 200, "") in sent, "the load")
        loop.add("r1", {"prompt_token_ids": PROMPT}, params, req)
        loop.lora.submit(UnloadLoRA(2, 5, "a"))
        wait(lambda: 5 in loop.lora.retired, "the unload to start")
        loop.add("r2", {"prompt_token_ids": PROMPT}, params, req)
        wait(lambda: LoRAAnswer(2, 200, "") in sent, "the unload")
    finally:
        loop.stop()
    items = [(i, item) for i, m in enumerate(sent) if isinstance(m, StepOutputs) for item in m.items]
    (r2,) = [item for _, (rid, item) in items if rid == "r2"]
    assert isinstance(r2, StreamError) and r2.invalid_request and "its LoRA adapter was unloaded" in r2.message
    tokens = sum(len(d.token_ids) for _, (rid, u) in items if rid == "r1" and isinstance(u, Update)
                 for d in u.deltas)
    assert tokens == 40
    end = [i for i, (rid, item) in items if rid == "r1" and item is None]
    assert end and end[0] < sent.index(LoRAAnswer(2, 200, ""))
    assert llm.engine.runner.lora.folders == {} and llm.engine.runner.lora.slots == {}


def test_load_inplace_replaces_the_adapter(server, client, folders, peft):
    """vLLM's load_inplace: the name now runs the new folder (one card, its root the new folder); the old adapter's
    id is unloaded in the background."""
    _load(client, "a", folders["a"])
    old_id = next(lid for lid, f in server.llm.engine.runner.lora.folders.items() if f.endswith("/a"))
    assert client.post("/load_lora_adapter", cast_to=str, body={
        "lora_name": "a", "lora_path": str(folders["b"]), "load_inplace": True}) == \
        "Success: LoRA adapter 'a' added successfully."
    cards = [m for m in client.models.list().data if m.id == "a"]
    assert len(cards) == 1 and cards[0].model_extra["root"] == str(folders["b"])
    _assert_peft(_complete(client, "a"), peft["b"])
    deadline = time.monotonic() + 10
    while old_id in server.llm.engine.runner.lora.folders:
        assert time.monotonic() < deadline, "the replaced adapter was not unloaded"
        time.sleep(0.01)
    _unload(client, "a")
    assert _slots(server)["ids"] == set()
