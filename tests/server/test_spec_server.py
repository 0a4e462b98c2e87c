"""``sparrow serve`` with speculative decoding (the LLM's speculative_config, as --speculative-config sets it):
greedy completions through the official openai client equal plain decoding's, and /metrics carries vLLM's
spec_decode counters, equal to the engine's."""
from __future__ import annotations

import httpx
import openai

from sparrow import LLM, SamplingParams
from tests.helpers import tiny_text_model_dir  # noqa: F401  (fixture)
from tests.server.conftest import start_server, stop_server

PROMPTS = ["abcabcabcabc", "hello hello hello", "xyz"]


def test_served_speculation_equals_plain_and_reports_metrics(tiny_text_model_dir):  # noqa: F811
    kw = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64)
    plain = LLM(str(tiny_text_model_dir), **kw)
    ref = [o.outputs[0].text for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    llm = LLM(str(tiny_text_model_dir), **kw, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    running = start_server(llm, served_model_name="tiny")
    try:
        client = openai.OpenAI(base_url=running.base_url, api_key="none")
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
               for p in PROMPTS]
        assert got == ref
        metrics = httpx.get(running.url + "/metrics").text
    finally:
        stop_server(running)
    engine = llm.engine.spec.metrics()
    assert engine["sparrow:spec_decode_num_drafts"] > 0
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        line = next(ln for ln in metrics.splitlines() if ln.startswith(f"sparrow:{name}_total{{"))
        assert float(line.rsplit(" ", 1)[1]) == engine[f"sparrow:{name}"]
    per_pos = [ln for ln in metrics.splitlines() if ln.startswith("sparrow:spec_decode_num_accepted_tokens_per_pos_total")]
    assert len(per_pos) == 3
