"""The server's warm-up (sparrow/engine/warmup.py): the ladder of prefill lengths, and that warming up leaves
the engine as it found it (no request, every block free, the same greedy output afterwards)."""
from __future__ import annotations

from sparrow import SamplingParams
from sparrow.engine.warmup import prefill_lengths, split_prompt_lengths, warm_up
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


def test_warm_up_steps_reach_the_token_budget_with_short_prompts(tiny_model_dir):  # noqa: F811
    """max_model_len below the step budget: the warm-up's largest steps are made of several prompts and fill the
    budget, alone and beside decoding sequences, as a loaded server's steps do."""
    llm = make_llm(tiny_model_dir, max_model_len=24, num_kv_blocks=64, block_size=16, max_num_batched_tokens=64,
                   max_num_seqs=8)
    engine = llm.engine
    seen = []
    run = engine.runner.run

    def record(plan, **kw):
        seen.append((sum(item.num_new_tokens for item in plan.seqs), len(plan.seqs)))
        return run(plan, **kw)

    engine.runner.run = record
    warm_up(engine)
    assert max(tokens for tokens, _ in seen) == 64
    assert max(seqs for tokens, seqs in seen if tokens == 64) >= 3  # 64 tokens of prompts of at most 22 tokens
    # beside 5 decoding sequences (the ladder up to max_num_seqs - 1 = 7): 33 prompt tokens as two prompts
    assert any(seqs >= 7 and tokens >= 33 + 5 for tokens, seqs in seen)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_split_prompt_lengths():
    assert split_prompt_lengths(64, 22) == [22, 21, 21]
    assert split_prompt_lengths(5, 22) == [5]
    assert sum(split_prompt_lengths(2049, 191)) == 2049 and max(split_prompt_lengths(2049, 191)) <= 191
