"""The step pipeline's plan shapes beyond one row per sequence, on CPU.

Oracles: running the same tokens one row at a time through the same engine (each row's logits then come from a
decode step over the cache the earlier rows filled); the solo outputs of each request for the prefix-cache
livelock; the block manager's contract (rejected slots given back, no prefix-cache entry for them).
"""
from __future__ import annotations

import pytest
import torch

from sparrow import SamplingParams
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.forward_inputs import forward_batch, step_rows
from sparrow.engine.sequence import Sequence
from sparrow.engine.step_plan import ScheduledSeq, StepPlan
from tests.helpers import (ids_prompt, make_llm, random_prompts, tiny_model_dir,  # noqa: F401  (fixtures)
                           tiny_text_model_dir)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prefilled(engine, prompt: list[int], runner=None) -> Sequence:
    """A sequence whose prompt but its last token is in the cache (a prefill plan of n - 1 rows, none sampled)."""
    seq = Sequence(str(len(prompt)), 0, list(prompt), SamplingParams(**GREEDY), set())
    engine.block_manager.allocate(seq, len(prompt) + 8)
    (runner or engine.runner).run(StepPlan([ScheduledSeq(seq, 0, len(prompt) - 1)]))
    seq.num_computed_tokens = len(prompt) - 1
    return seq


def _logits(engine, plan: StepPlan, runner=None) -> torch.Tensor:
    runner = runner or engine.runner
    batch = forward_batch(step_rows(plan, runner.block_size), None, runner.pad_block, runner.device)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch)[batch.sample_rows])


def test_verify_shaped_plan_equals_rows_one_by_one(tiny_model_dir):
    """3 sequences with 1 / 4 / 1 query rows (the middle one a verify of 3 draft tokens), every row of each
    sampled: the 6 logits rows equal those of feeding the same tokens one row per step."""
    prompts = random_prompts([9, 21, 5], seed=31)
    drafts = random_prompts([3], seed=32)[0]
    engine = make_llm(tiny_model_dir).engine
    seqs = [_prefilled(engine, p) for p in prompts]
    items = [ScheduledSeq(s, s.num_computed_tokens, n, num_sampled=n, draft_token_ids=d)
             for s, n, d in zip(seqs, (1, 4, 1), ([], drafts, []))]
    got = _logits(engine, StepPlan(items))
    assert got.shape[0] == 6

    one = make_llm(tiny_model_dir).engine
    want = []
    for p, extra in zip(prompts, ([], drafts, [])):
        seq = _prefilled(one, p + extra)  # the same tokens, then one row per step
        seq.num_computed_tokens = len(p) - 1
        for j in range(len(extra) + 1):
            want.append(_logits(one, StepPlan([ScheduledSeq(seq, len(p) - 1 + j, 1, num_sampled=1)]))[0])
            seq.num_computed_tokens += 1
    torch.testing.assert_close(got, torch.stack(want), atol=1e-4, rtol=1e-4)


def test_truncate_gives_back_rejected_slots_without_prefix_entries():
    """A sequence that wrote K/V for 4 draft tokens past its prompt keeps only the blocks its accepted tokens
    need; the freed blocks are handed out next, and only the prompt's computed blocks are in the prefix cache."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence("a", 0, list(range(9)), SamplingParams(), set())
    bm.allocate(seq, 9 + 4 + 4)            # prompt + bonus + 4 drafts + 3 spare: 5 blocks
    seq.num_computed_tokens = 9
    bm.commit_computed(seq)
    hashed = dict(bm.block_hash)
    assert len(seq.block_table) == 5 and set(hashed) == set(seq.block_table[:2])  # (9 - 1) // 4 prompt blocks
    tail = seq.block_table[3:]
    bm.truncate(seq, 10)                    # keep 10 slots: 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.block_hash == hashed          # nothing registered for the given-back slots
    other = Sequence("b", 0, [50] * 8, SamplingParams(), set())
    bm.allocate(other, 8 + 3 * 4)           # takes every free block: the two given back first (LRU order)
    assert tail[0] in other.block_table and tail[1] in other.block_table
    assert all(bm.ref_counts[b] == 1 for b in tail)


def test_rejected_drafts_roll_back_and_generation_stays_exact(tiny_model_dir):
    """A verify step whose drafts are half right (the first two are the greedy continuation, the third is not)
    appends the two and the target's own third token, gives back the rest, and the sequence goes on exactly as
    plain decoding does. (The engine has a speculator, n-gram: accepting drafts is its ``accept``.)"""
    prompt = random_prompts([13], seed=33)[0]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    want = make_llm(tiny_model_dir).generate(ids_prompt(prompt), sp)[0].outputs[0].token_ids
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.engine
    rid = engine.add_request(ids_prompt(prompt), sp)
    engine.step()                            # prefill: the first token
    seq = engine.requests[rid][1][0]
    drafts = [want[1], want[2], (want[3] + 1) % 256]
    free = engine.block_manager.num_free_blocks
    engine.block_manager.allocate(seq, seq.num_tokens + len(drafts))
    item = ScheduledSeq(seq, seq.num_computed_tokens, 4, num_sampled=4, draft_token_ids=drafts)
    engine._apply(StepPlan([item]), engine.runner.run(StepPlan([item])))
    assert seq.output_token_ids == want[:4] and seq.num_computed_tokens == len(prompt) + 3
    assert engine.block_manager.num_free_blocks == free - (-(-(seq.num_computed_tokens + 1) // 16)
                                                           - -(-len(prompt) // 16))
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == want


def test_prefix_cache_hit_waiting_does_not_livelock(tiny_model_dir):
    """A waiting request whose prompt hits the prefix cache must not pin the blocks the running one needs:
    A (63 tokens), A[:10], A again in a pool of 4 blocks of 16 all finish, with their solo outputs."""
    a = random_prompts([63], seed=34)[0]
    sp = SamplingParams(max_tokens=40, **GREEDY)
    solo = {}
    for p in (a, a[:10]):
        solo[len(p)] = make_llm(tiny_model_dir, max_model_len=64).generate(ids_prompt(p), sp)[0].outputs[0].token_ids
    llm = make_llm(tiny_model_dir, max_model_len=64, num_kv_blocks=4, enable_prefix_caching=True)
    engine = llm.engine
    rids = [engine.add_request(ids_prompt(p), sp) for p in (a, a[:10], a)]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 200, (steps, engine.scheduler.num_preemptions)
    assert [done[r] for r in rids] == [solo[63], solo[10], solo[63]]
    assert engine.block_manager.num_free_blocks == 4


def test_request_output_reports_the_step_delta(tiny_model_dir):
    """Each step's RequestOutput carries the tokens it added (delta_token_ids) beside the cumulative ones: the
    deltas of all steps join to the final token ids."""
    prompt = random_prompts([7], seed=35)[0]
    engine = make_llm(tiny_model_dir).engine
    engine.add_request(ids_prompt(prompt), SamplingParams(max_tokens=9, **GREEDY))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(list(out.outputs[0].delta_token_ids))
            final = list(out.outputs[0].token_ids)
    assert all(len(d) == 1 for d in deltas) and sum(deltas, []) == final and len(final) == 9


def test_text_deltas_hold_back_what_a_stop_string_may_take(tiny_text_model_dir):
    """The engine's text deltas (what a server streams) never contain text a stop string later removes: with a
    stop string that occurs mid-generation, the deltas join to the final (cut) text, and each step's cumulative
    text is the join of the deltas so far."""
    llm = make_llm(tiny_text_model_dir, skip_tokenizer_init=False)
    full = llm.generate("abc", SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].text
    i = next(i for i in range(3, len(full) - 3) if full.find(full[i:i + 3]) == i)
    engine = llm.engine
    engine.add_request("abc", SamplingParams(max_tokens=24, stop=[full[i:i + 3]], **GREEDY))
    joined, steps = "", 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            joined += out.outputs[0].delta_text
            assert out.outputs[0].text == joined
            steps += 1
    assert joined == full[:i] and steps > 2


@pytest.mark.gpu
def test_verify_step_replays_a_graph_of_q_rows(tiny_model_dir):
    """With graphs for q = 1 and q = 4 rows per sequence, a step of 3 sequences with 4 sampled rows each replays
    the (bucket 4, q 4) graph, whose logits match the eager forward of the same plan."""
    from sparrow.engine.model_runner import ModelRunner

    engine = make_llm(tiny_model_dir, device="cuda", max_num_seqs=4).engine
    runner = ModelRunner(engine.config, engine.runner.model, query_lens=(1, 4))  # rebinds the KV cache to itself
    assert runner.graphs.bucket_for(3, 4) == 4 and runner.graphs.bucket_for(3, 2) is None
    seqs = [_prefilled(engine, p, runner) for p in random_prompts([9, 21, 5], seed=36)]
    drafts = random_prompts([3, 3, 3], seed=37)
    plan = StepPlan([ScheduledSeq(s, s.num_computed_tokens, 4, num_sampled=4, draft_token_ids=d)
                     for s, d in zip(seqs, drafts)])
    eager = _logits(engine, plan, runner)
    replays = []
    real = runner.graphs.run
    runner.graphs.run = lambda *a, **k: replays.append(a[:2]) or real(*a, **k)
    rows = step_rows(plan, runner.block_size)
    graph = runner.graphs.run(3, 4, rows.input_ids, rows.positions, rows.slot_mapping, rows.seq_lens,
                              rows.block_tables)
    torch.testing.assert_close(graph, eager, atol=2e-3, rtol=2e-3)
    assert runner.run(plan).token_ids() == eager.argmax(-1).tolist()
    assert replays == [(3, 4), (3, 4)]
