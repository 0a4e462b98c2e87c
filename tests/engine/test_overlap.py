"""Overlapped greedy decode (switches.OVERLAP): the next decode step is queued before the current one is read.

Oracle: the same engine with OVERLAP off (every step read before the next is built), itself checked against
transformers in test_engine.py, which runs with OVERLAP on (the default). Token ids, finish and stop reasons
must be identical. On CPU the steps run eagerly (no CUDA graphs), which exercises the same bookkeeping:
queued rows, device-fed input tokens, dropped rows of sequences that stopped, rows left out at max_tokens.
"""
from __future__ import annotations

import pytest

from sparrow import SamplingParams
from sparrow import switches
from tests.helpers import ids_prompt, make_llm, random_prompts, tiny_model_dir  # noqa: F401  (fixture)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _count_launches(monkeypatch, engine) -> dict:
    """Count the runner's decode steps, by whether their input tokens came from the device (queued ahead), and
    the queued steps that left a sequence out."""
    counts = {"host": 0, "fed": 0, "partial": 0}
    run = engine.runner.run

    def counting(plan, previous=None):
        if all(item.num_new_tokens == 1 and item.samples and item.start >= item.seq.num_prompt_tokens
               for item in plan.seqs):
            counts["fed" if previous is not None else "host"] += plan.queue_next or previous is not None
        return run(plan, previous)

    monkeypatch.setattr(engine.runner, "run", counting)
    real_ahead = engine.scheduler.schedule_ahead

    def ahead(plan):
        nxt = real_ahead(plan)
        if nxt is not None and len(nxt.seqs) < len(plan.seqs):
            counts["partial"] += 1
        return nxt

    monkeypatch.setattr(engine.scheduler, "schedule_ahead", ahead)
    return counts


def _run(engine, requests, join_after: int, late) -> dict:
    """Add ``requests`` [(prompt, params)], step; after ``join_after`` steps add ``late``; returns
    {request_id: (token_ids, finish_reason, stop_reason)}."""
    rids = [engine.add_request(ids_prompt(p), sp) for p, sp in requests]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason)
        steps += 1
        if steps == join_after:
            rids.append(engine.add_request(ids_prompt(late[0]), late[1]))
        assert steps < 1000
    return [done[r] for r in rids]


def test_overlapped_decode_equals_plain_steps(tiny_model_dir, monkeypatch):
    prompts = random_prompts([5, 18, 9, 30, 12], seed=21)
    plain_llm = make_llm(tiny_model_dir)
    monkeypatch.setattr(switches, "OVERLAP", False)
    free = plain_llm.generate(ids_prompt(prompts[1]), SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(free) if i >= 4 and t not in free[:i])  # a token first made at step >= 4
    requests = [
        (prompts[0], SamplingParams(max_tokens=3, **GREEDY)),  # leaves the queued steps early
        (prompts[1], SamplingParams(max_tokens=20, stop_token_ids=[stop], **GREEDY)),  # stops mid-run: row dropped
        (prompts[2], SamplingParams(max_tokens=7, **GREEDY)),
        (prompts[3], SamplingParams(max_tokens=16, **GREEDY)),
    ]
    late = (prompts[4], SamplingParams(max_tokens=6, **GREEDY))  # joins while steps are being queued
    want = _run(make_llm(tiny_model_dir).engine, requests, 6, late)
    assert want[1][1] == "stop" and want[1][2] == stop  # the stop really happens inside the run

    monkeypatch.setattr(switches, "OVERLAP", True)
    engine = make_llm(tiny_model_dir).engine
    counts = _count_launches(monkeypatch, engine)
    got = _run(engine, requests, 6, late)
    assert got == want
    assert counts["fed"] >= 10 and counts["partial"] >= 1, counts  # it did queue steps, some without a row
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def test_abort_with_a_queued_step(tiny_model_dir, monkeypatch):
    """Aborting while a step is queued frees every block (the queued step's too); the stale step is dropped and
    the next request generates what a fresh engine does."""
    monkeypatch.setattr(switches, "OVERLAP", True)
    p1, p2 = random_prompts([20, 11], seed=22)
    sp = SamplingParams(max_tokens=30, **GREEDY)
    engine = make_llm(tiny_model_dir).engine
    free0 = engine.block_manager.num_free_blocks
    rid = engine.add_request(ids_prompt(p1), sp)
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None
    engine.abort(rid)
    assert engine.block_manager.num_free_blocks == free0 and not engine.has_unfinished_requests()
    got = _run(engine, [(p2, sp)], -1, None)
    fresh = make_llm(tiny_model_dir).generate(ids_prompt(p2), sp)[0].outputs[0]
    assert got == [(fresh.token_ids, "length", None)]
    assert engine.block_manager.num_free_blocks == free0


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, seed=1), dict(temperature=0.0, logprobs=2), dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.0, min_tokens=8),
], ids=["sampled", "logprobs", "penalty", "min_tokens"])
def test_steps_that_need_the_host_are_not_queued(tiny_model_dir, monkeypatch, params):
    """Rows the sampler treats beyond an argmax (random draws, logprobs, penalties, min_tokens) need the host's
    view of every token: those steps run one at a time and give the OVERLAP-off tokens."""
    prompt = random_prompts([14], seed=23)[0]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, **params)
    monkeypatch.setattr(switches, "OVERLAP", False)
    want = make_llm(tiny_model_dir).generate(ids_prompt(prompt), sp)[0].outputs[0].token_ids
    monkeypatch.setattr(switches, "OVERLAP", True)
    llm = make_llm(tiny_model_dir)
    counts = _count_launches(monkeypatch, llm.engine)
    assert llm.generate(ids_prompt(prompt), sp)[0].outputs[0].token_ids == want
    assert counts == {"host": 0, "fed": 0, "partial": 0}


@pytest.mark.gpu
def test_overlapped_decode_on_cuda_graphs_equals_plain_steps(tiny_model_dir, monkeypatch):
    """On the GPU the queued steps replay the decode graphs with device-fed input ids and are read through
    a pinned copy behind an event (StepResult); same workload and oracle as the CPU test."""
    prompts = random_prompts([5, 18, 9, 30], seed=24)
    requests = [(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts, (3, 20, 7, 16))]
    late = (random_prompts([12], seed=25)[0], SamplingParams(max_tokens=6, **GREEDY))
    monkeypatch.setattr(switches, "OVERLAP", False)
    want = _run(make_llm(tiny_model_dir, device="cuda").engine, requests, 6, late)
    monkeypatch.setattr(switches, "OVERLAP", True)
    engine = make_llm(tiny_model_dir, device="cuda").engine
    assert engine.runner.graphs is not None
    counts = _count_launches(monkeypatch, engine)
    assert _run(engine, requests, 6, late) == want
    assert counts["fed"] >= 10, counts
