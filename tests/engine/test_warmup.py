"""The server's warm-up (sparrow/engine/warmup.py): the ladder of prefill lengths, and that warming up leaves
the engine as it found it (no request, every block free, the same greedy output afterwards)."""
from __future__ import annotations

from sparrow import SamplingParams
from sparrow.engine.warmup import prefill_lengths, warm_up
from tests.helpers import generate_ids, make_llm, random_prompts, tiny_model_dir  # noqa: F401  (fixture)


def test_prefill_lengths_cover_both_specializations():
    assert prefill_lengths(16) == [1, 2, 3, 4, 5, 8, 9, 16]
    assert prefill_lengths(1) == [1]
    lengths = prefill_lengths(2048)
    assert lengths[-1] == 2048 and all(p + 1 in lengths for p in (64, 512, 1024))
    assert lengths == sorted(set(lengths)) and max(lengths) <= 2048


def test_warm_up_leaves_the_engine_idle_and_unchanged(tiny_model_dir):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts([5, 17, 40])
    fresh = generate_ids(make_llm(tiny_model_dir, max_model_len=128, num_kv_blocks=64, block_size=16,
                                  max_num_batched_tokens=64, max_num_seqs=4), prompts, params)
    llm = make_llm(tiny_model_dir, max_model_len=128, num_kv_blocks=64, block_size=16, max_num_batched_tokens=64,
                   max_num_seqs=4)
    engine = llm.engine
    steps = warm_up(engine)
    lengths = prefill_lengths(64)
    assert steps >= 2 * len(lengths)  # each prefill alone: its prefill step and one decode step
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert generate_ids(llm, prompts, params) == fresh
