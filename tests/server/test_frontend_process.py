"""The front end's process and the engine loop's messages: coalescing of updates a slow reader missed, a port
that cannot be bound, and the engine's state reaching /metrics."""
from __future__ import annotations

import socket

import pytest

from sparrow.errors import SparrowError
from sparrow.outputs import Logprob
from sparrow.server.messages import Delta, Update, merge_updates


def _lp(tid: int, v: float) -> dict[int, Logprob]:
    return {tid: Logprob(v, 1, str(tid))}


def test_merge_updates_concatenates_each_completion():
    a = Update([Delta(0, "He", [1], [_lp(1, -0.1)], None, None), Delta(1, "", [], [], None, None)], False)
    b = Update([Delta(0, "llo", [2, 3], [_lp(2, -0.2), _lp(3, -0.3)], "stop", 3),
                Delta(1, "x", [4], [_lp(4, -0.4)], "length", None)], True, [None, _lp(8, -1.0)])
    m = merge_updates(a, b)
    d0, d1 = sorted(m.deltas, key=lambda d: d.index)
    assert (d0.text, d0.token_ids, [next(iter(x)) for x in d0.logprobs]) == ("Hello", [1, 2, 3], [1, 2, 3])
    assert (d0.finish_reason, d0.stop_reason) == ("stop", 3)
    assert (d1.text, d1.token_ids, d1.finish_reason) == ("x", [4], "length")
    assert m.finished and m.prompt_logprobs == b.prompt_logprobs
    assert a.deltas[0].text == "He" and a.deltas[0].token_ids == [1]  # the inputs are left as they were


def test_port_in_use_is_a_clear_error(tiny_llm):
    from sparrow.server.launch import start_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SparrowError, match=f"could not listen on 127.0.0.1:{port}"):
            start_server(tiny_llm, host="127.0.0.1", port=port, startup_timeout=60)
    assert not tiny_llm.engine.requests


def test_warm_up_is_not_counted_in_metrics(tiny_text_model_dir):
    """A server that warmed up (as on CUDA) starts /metrics at zero: the warm-up's prefills are the baseline."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from sparrow import LLM
    from tests.server.conftest import start_server, stop_server

    llm = LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32,
              max_num_batched_tokens=32, max_num_seqs=4)
    srv = start_server(llm, served_model_name="tiny", warm_up=True)
    try:
        assert llm.engine.block_manager.prefix_cache_queries > 0  # the warm-up ran
        samples = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                   for s in fam.samples}
        assert samples["sparrow:prefix_cache_queries_total"] == 0
        assert samples["sparrow:generation_tokens_total"] == 0
        r = httpx.post(srv.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_server(srv)


def test_kernel_variants_are_watched_while_the_loop_runs():
    """The engine loop's watch on Triton's jit_cache_hook (named in its slow-step log line): it records each
    variant's description, calls a hook set before it, and is removed again."""
    knobs = pytest.importorskip("triton").knobs
    from sparrow.server.engine_loop import watch_kernel_variants

    calls = []
    knobs.runtime.jit_cache_hook = lambda **kw: calls.append(kw["repr"]) or False
    try:
        seen: list[str] = []
        undo = watch_kernel_variants(seen)
        assert knobs.runtime.jit_cache_hook(repr="k[num_warps=4](x: *fp32)", key=None) is False
        assert seen == calls == ["k[num_warps=4](x: *fp32)"]
        undo()
        knobs.runtime.jit_cache_hook(repr="other")
        assert seen == ["k[num_warps=4](x: *fp32)"]
    finally:
        knobs.runtime.jit_cache_hook = None
