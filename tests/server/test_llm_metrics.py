"""``LLM.get_metrics()``: the server's counters on the in-process LLM, checked against the requests run."""
from __future__ import annotations

from sparrow import SamplingParams
from tests.helpers import ids_prompt, make_llm, random_prompts, tiny_model_dir  # noqa: F401


def test_llm_get_metrics(tiny_model_dir):  # noqa: F811
    llm = make_llm(tiny_model_dir, block_size=16, num_kv_blocks=64, max_model_len=256)
    before = llm.get_metrics()
    assert before["sparrow:prompt_tokens"] == 0 and before["sparrow:request_success"] == {}
    prefix = random_prompts([40], seed=3)[0]
    prompts = [prefix + [5, 6], prefix + [7]]
    outs = [llm.generate(ids_prompt(p), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
            for p in prompts]  # one after the other: the second finds the first's full blocks cached
    m = llm.get_metrics()
    assert m["sparrow:prompt_tokens"] == sum(len(p) for p in prompts)
    assert m["sparrow:generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert m["sparrow:request_success"] == {"length": 2}
    assert m["sparrow:prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert m["sparrow:prefix_cache_hits"] == 32  # two full 16-token blocks of the shared 40-token prefix
    assert m["sparrow:kv_cache_usage_perc"] == 0.0 and m["sparrow:num_requests_running"] == 0
    assert m["sparrow:num_requests_waiting"] == 0 and m["sparrow:num_preemptions"] == 0
