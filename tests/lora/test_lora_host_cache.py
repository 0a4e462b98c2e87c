"""The host cache of adapters (``max_cpu_loras``, sparrow/lora/manager.py): more adapters than it holds, across
generate calls, give exactly the outputs of an unbounded cache (fp32, the same batches); it never holds more than
max_cpu_loras adapters, or max_loras + 1 when max_cpu_loras == max_loras (the documented exception); a dropped
adapter is read again from its folder; one whose folder is gone by then fails its own request with
LoRAAdapterError (LLM.generate raises it, the engine and the server's loop go on with the others); max_cpu_loras
below max_loras is refused; ``sparrow serve --max-cpu-loras`` reaches the engine. Tiny random Llama, PEFT adapters
(their outputs against PEFT: test_lora_peft.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sparrow import LoRARequest, SamplingParams
from sparrow.errors import InvalidRequestError, LoRAAdapterError
from tests.helpers import make_llm
from tests.lora._adapters import base_model, make_adapter

PROMPTS = [[5, 6, 7, 8, 9], [40, 2, 33], [7, 7, 8, 100, 3, 9, 14]]
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
TARGETS = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], ["k_proj", "q_proj"],
           ["v_proj", "o_proj"]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-host-cache")
    base = base_model("llama", root / "base")
    return base, [make_adapter("llama", base, root / f"a{i}", seed=i, r=2 + i % 3, lora_alpha=8, target_modules=t)
                  for i, t in enumerate(TARGETS, start=1)]


def _req(folders, i):
    """Adapter i (1-based; 0: the base model) as a LoRARequest with id i."""
    return LoRARequest(f"a{i}", i, str(folders[1][i - 1])) if i else None


def _ids(outs):
    """Each output's token ids and their logprobs."""
    return [(o.outputs[0].token_ids, [list(d.values())[0].logprob for d in o.outputs[0].logprobs]) for o in outs]


def _tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture
def reads(monkeypatch):
    """lora_int_id of every adapter folder read (``load_adapter`` calls), in order."""
    import sparrow.lora.manager as manager

    seen, real = [], manager.load_adapter

    def counted(request, *args, **kw):
        seen.append(request.lora_int_id)
        return real(request, *args, **kw)

    monkeypatch.setattr(manager, "load_adapter", counted)
    return seen


def test_bounded_cache_gives_the_unbounded_outputs(folders, reads):
    """Four generate calls over five adapters and the base model with max_loras=2: with max_cpu_loras=2 (the
    default) adapters are dropped and read again, and every token and logprob equals those of a cache that keeps
    all five."""
    runs = [(1, 2, 0), (3, 4, 1), (5, 2, 3), (1, 0, 4)]

    def outputs(**kw):
        llm = make_llm(folders[0], max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=4, **kw)
        got = [_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                                 lora_request=[_req(folders, i) for i in run])) for run in runs]
        return got, llm.engine.runner.lora

    unbounded, mgr = outputs(max_cpu_loras=100)
    assert sorted(reads) == [1, 2, 3, 4, 5] and len(mgr.adapters) == 5  # each folder read once, all kept
    reads.clear()
    bounded, mgr = outputs()
    assert mgr.max_cpu_loras == 2 and len(mgr.adapters) <= 3
    assert len(reads) > 5  # adapters were dropped and read again
    assert bounded == unbounded
    assert len({tuple(ids) for run in unbounded for ids, _ in run}) > len(PROMPTS)  # the adapters differ


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (2, 2), (2, 3)])
def test_the_cache_holds_at_most_its_bound(folders, max_loras, max_cpu_loras):
    """Requests of five adapters (and the base model) added between steps: after every add_request and every step the
    host cache holds at most max_cpu_loras adapters, or max_loras + 1 when max_cpu_loras == max_loras (an adapter read
    in while every other cached one is in a slot); with max_cpu_loras > max_loras never more than max_cpu_loras."""
    llm = make_llm(folders[0], max_model_len=64, enable_lora=True, max_loras=max_loras, max_lora_rank=4,
                   max_cpu_loras=max_cpu_loras)
    engine, mgr = llm.engine, llm.engine.runner.lora
    bound = max_loras + 1 if max_cpu_loras == max_loras else max_cpu_loras
    sizes = []
    for k, i in enumerate([1, 2, 0, 3, 1, 4, 5, 2, 0, 5, 3, 1]):
        engine.add_request({"prompt_token_ids": PROMPTS[k % 3]}, PARAMS, lora_request=_req(folders, i))
        sizes.append(len(mgr.adapters))
        for _ in range(k % 3):
            engine.step()
            sizes.append(len(mgr.adapters))
    while engine.has_unfinished_requests():
        engine.step()
        sizes.append(len(mgr.adapters))
    assert max(sizes) <= bound, sizes
    assert max(sizes) == bound  # the bound is reached (the exception too, where there is one)
    assert not engine.failed and not engine.requests


def test_a_dropped_adapter_is_read_again(folders, reads):
    """max_loras = max_cpu_loras = 1: adapter 1 is dropped when adapter 3 is read in (2 holds the slot), and its
    next request reads its folder again (same id, same folder) and gives its first outputs."""
    llm = make_llm(folders[0], max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=4, max_cpu_loras=1)
    mgr = llm.engine.runner.lora

    def run(i):
        return _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=_req(folders, i)))

    first = run(1)
    run(2)
    run(3)
    assert 1 not in mgr.adapters and reads == [1, 2, 3]
    assert run(1) == first
    assert reads == [1, 2, 3, 1] and 1 in mgr.adapters and mgr.folders[1] == str(folders[1][0].resolve())


def _move_after_reading(monkeypatch, folder, trigger: int):
    """Rename ``folder`` (to ``<folder>-gone``) as soon as the adapter of id ``trigger`` has been read."""
    import sparrow.lora.manager as manager

    real = manager.load_adapter

    def read(request, *args, **kw):
        adapter = real(request, *args, **kw)
        if request.lora_int_id == trigger and folder.exists():
            folder.rename(folder.with_name(folder.name + "-gone"))
        return adapter

    monkeypatch.setattr(manager, "load_adapter", read)
    return folder.with_name(folder.name + "-gone")


@pytest.fixture
def one_slot(folders, tmp_path):
    """An LLM with max_loras = max_cpu_loras = 1, adapter 1's folder a copy that a test may move away, and the
    expected tokens of adapter 2 and of the base model."""
    copy = tmp_path / "a1"
    shutil.copytree(folders[1][0], copy)
    llm = make_llm(folders[0], max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=4, max_cpu_loras=1)
    want = {i: _tokens(llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=_req(folders, i))[0])
            for i in (0, 2)}
    assert want[0] != want[2]
    llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=_req(folders, 3))  # 3 in the slot
    return llm, LoRARequest("a1", 1, str(copy)), want


def test_an_unreadable_dropped_adapter_fails_its_request_only(one_slot, folders, monkeypatch):
    """Adapter 1 is read when its request is added, dropped when adapter 2's is (3 holds the slot), and its folder
    is gone when its request reaches a step: that request ends with a LoRAAdapterError naming the adapter and the
    folder, in ``Engine.failed``; the base-model and adapter-2 requests added with it run to their usual outputs."""
    llm, lost, want = one_slot
    gone = _move_after_reading(monkeypatch, Path(lost.lora_path), trigger=2)
    engine = llm.engine
    rids = {i: engine.add_request({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=r)
            for i, r in ((1, lost), (2, _req(folders, 2)), (0, None))}
    assert gone.exists() and 1 not in engine.runner.lora.adapters
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    error = engine.failed.pop(rids[1])
    assert isinstance(error, LoRAAdapterError) and "'a1'" in str(error)
    assert os.path.realpath(lost.lora_path) in str(error)
    assert rids[1] not in done and not engine.failed and not engine.requests
    assert {i: _tokens(done[rids[i]]) for i in (0, 2)} == want


def test_generate_raises_the_error_and_the_llm_goes_on(one_slot, folders, monkeypatch):
    """The same through LLM.generate: the call raises the LoRAAdapterError of adapter 1 (its requests aborted), and
    the next call runs."""
    llm, lost, want = one_slot
    _move_after_reading(monkeypatch, Path(lost.lora_path), trigger=2)
    with pytest.raises(LoRAAdapterError, match=r"LoRA adapter 'a1': .* is not a folder"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, PARAMS, lora_request=[lost, _req(folders, 2), None])
    assert not llm.engine.requests and not llm.engine.failed
    assert _tokens(llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=_req(folders, 2))[0]) == want[2]


def test_the_server_loop_reports_the_error_to_its_request(one_slot, folders, monkeypatch):
    """The server's engine loop sends that request a StreamError with the adapter's message (a 400, as when the
    adapter is refused on arrival) and the others their outputs."""
    import threading

    from sparrow.server.engine_loop import EngineLoop
    from sparrow.server.messages import LoadLoRA, LoRAAnswer, StepOutputs, StreamError, UnloadLoRA, Update

    llm, lost, want = one_slot
    _move_after_reading(monkeypatch, Path(lost.lora_path), trigger=2)
    items, ended = [], threading.Event()

    def send(msg):
        items.extend(msg.items)
        if sum(1 for _, item in items if item is None or isinstance(item, StreamError)) == 3:
            ended.set()

    loop = EngineLoop(llm.engine, send)
    for rid, r in (("x1", lost), ("x2", _req(folders, 2)), ("x0", None)):
        loop.add(rid, {"prompt_token_ids": PROMPTS[0]}, PARAMS, r)
    loop.start()
    try:
        assert ended.wait(30)
    finally:
        loop.stop()
    errors = [(rid, item) for rid, item in items if isinstance(item, StreamError)]
    assert [rid for rid, _ in errors] == ["x1"] and errors[0][1].invalid_request
    assert "LoRA adapter 'a1'" in errors[0][1].message
    for rid, i in (("x0", 0), ("x2", 2)):
        ids = [t for r, item in items if r == rid and isinstance(item, Update) for t in item.deltas[0].token_ids]
        assert ids == want[i], rid


def test_max_cpu_loras_below_max_loras_is_refused(folders):
    with pytest.raises(ValueError, match=r"max_cpu_loras=1 must be at least max_loras=2") as err:
        make_llm(folders[0], enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert isinstance(err.value, InvalidRequestError)
    with pytest.raises(InvalidRequestError, match="max_cpu_loras=0 must be at least 1"):
        make_llm(folders[0], enable_lora=True, max_loras=1, max_cpu_loras=0)
    llm = make_llm(folders[0], max_model_len=64, enable_lora=True, max_loras=3)  # default: max_loras
    assert llm.config.lora.max_cpu_loras == 3 and llm.engine.runner.lora.max_cpu_loras == 3


def test_serve_flag(capsys):
    """``sparrow serve --max-cpu-loras N`` (help from LoRAConfig's field docstring) reaches the engine; without it
    the cache holds max_loras; below --max-loras it is refused naming both."""
    from sparrow.cli import build_parser
    from sparrow.cli_support import field_docs
    from sparrow.config import LoRAConfig
    from sparrow.server.main import _build_llm

    parser = build_parser()
    serve = ["serve", "--model-shape", "tiny-dense", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
             "--enable-lora", "--max-loras", "2"]
    assert parser.parse_args(serve).max_cpu_loras is None
    assert parser.parse_args(serve + ["--max-cpu-loras", "5"]).max_cpu_loras == 5
    with pytest.raises(SystemExit):
        parser.parse_args(serve + ["--max-cpu-loras", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert field_docs(LoRAConfig)["max_cpu_loras"] in " ".join(capsys.readouterr().out.split())
    llm = _build_llm(parser.parse_args(serve + ["--max-cpu-loras", "5"]))
    assert llm.engine.runner.lora.max_cpu_loras == 5
    with pytest.raises(InvalidRequestError, match="max_cpu_loras=1 must be at least max_loras=2"):
        _build_llm(parser.parse_args(serve + ["--max-cpu-loras", "1"]))
