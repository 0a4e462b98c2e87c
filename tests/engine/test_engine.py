"""End-to-end engine tests on a tiny random Llama (tests/helpers.py).

Oracles: transformers (fp32 greedy tokens and log_softmax on the same weights; steps after the first
top-2 gap < 1e-4 are not compared), and sparrow itself in a simpler configuration (one request at a time,
unchunked prefill, a KV pool big enough to never preempt, prefix caching off). Tolerance: logprobs within
1e-4 (absolute) of transformers'; token ids exact.
"""
from __future__ import annotations

import math

import pytest
import torch

from sparrow import Logprob, SamplingParams
from tests.helpers import (
    LOGPROB_ATOL,
    copy_checkpoint,
    generate_ids,
    hf_greedy,
    hf_prompt_logprobs,
    ids_prompt,
    make_llm,
    random_prompts,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_text_model_dir,  # noqa: F401  (fixture)
    trusted_prefix,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run_to_completion(engine, max_steps: int = 10_000) -> dict:
    """Step until idle; returns {request_id: final RequestOutput}."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")


# ---------------------------------------------------------------- transformers oracle


@pytest.mark.parametrize("block_size", [16, 32])
def test_greedy_and_logprobs_match_transformers(tiny_model_dir, block_size):
    prompts = random_prompts([1, 5, 17, 33], seed=3)
    n_new = 12
    llm = make_llm(tiny_model_dir, block_size=block_size)
    outs = llm.generate([ids_prompt(p) for p in prompts], SamplingParams(max_tokens=n_new, logprobs=3, **GREEDY))
    compared = 0
    for p, out in zip(prompts, outs):
        comp = out.outputs[0]
        hf_ids, hf_lp, gaps = hf_greedy(tiny_model_dir, p, n_new)
        k = trusted_prefix(gaps)
        assert comp.token_ids[:k] == hf_ids[:k], f"prompt of {len(p)} tokens"
        assert len(comp.token_ids) == n_new and comp.finish_reason == "length"
        for step in range(k):
            d = comp.logprobs[step]
            for tid, lp in d.items():
                assert abs(lp.logprob - float(hf_lp[step, tid])) <= LOGPROB_ATOL, (step, tid)
            top3 = hf_lp[step].topk(3).indices.tolist()
            assert top3[0] in d and d[top3[0]].rank == 1
        compared += k
    assert compared >= 30, f"only {compared} greedy steps were free of near-ties"


def test_prompt_logprobs_match_transformers(tiny_model_dir):
    (prompt,) = random_prompts([30], seed=4)
    ref = hf_prompt_logprobs(tiny_model_dir, prompt)
    for budget in (2048, 8):  # unchunked, and prefill in chunks of 8
        llm = make_llm(tiny_model_dir, max_num_batched_tokens=budget)
        out = llm.generate(ids_prompt(prompt), SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))[0]
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for i in range(1, len(prompt)):
            d = plp[i]
            assert prompt[i] in d
            assert len(d) in (2, 3)  # top-2 plus the prompt token when it is not among them
            for tid, lp in d.items():
                assert abs(lp.logprob - float(ref[i - 1, tid])) <= LOGPROB_ATOL, (budget, i, tid)
            want_rank = 1 + int((ref[i - 1] > ref[i - 1, prompt[i]] + 1e-6).sum())
            assert abs(d[prompt[i]].rank - want_rank) <= 1


def test_prompt_logprobs_with_prefix_cache_and_preemption(tiny_model_dir):
    """Regression: a prefix-cache hit returned prompt logprobs for the uncached tail only, and a preempted
    sequence appended its prompt logprobs a second time when prefilled again."""
    prompts = random_prompts([40, 35, 50], seed=17)
    sp = SamplingParams(max_tokens=40, prompt_logprobs=1, **GREEDY)
    ref = make_llm(tiny_model_dir).generate([ids_prompt(p) for p in prompts], sp)
    small = make_llm(tiny_model_dir, num_kv_blocks=8, max_model_len=128)
    outs = small.generate([ids_prompt(p) for p in prompts], sp)
    assert small.engine.scheduler.num_preemptions > 0
    again = small.generate([ids_prompt(p) for p in prompts], sp)  # every prompt block is now in the cache
    for p, r, a, b in zip(prompts, ref, outs, again):
        for out in (a, b):
            assert len(out.prompt_logprobs) == len(p)
            assert out.outputs[0].token_ids == r.outputs[0].token_ids
            for dr, do in zip(r.prompt_logprobs[1:], out.prompt_logprobs[1:]):
                assert dr.keys() == do.keys()
                assert all(abs(dr[t].logprob - do[t].logprob) <= 1e-5 for t in dr)


# ---------------------------------------------------------------- batching invariance


def test_mixed_length_batch_equals_one_at_a_time(tiny_model_dir):
    prompts = random_prompts([3, 20, 7, 45, 1, 16], seed=5)
    sp = SamplingParams(max_tokens=10, **GREEDY)
    batched = generate_ids(make_llm(tiny_model_dir), prompts, sp)
    single = make_llm(tiny_model_dir, enable_prefix_caching=False)
    alone = [generate_ids(single, [p], sp)[0] for p in prompts]
    assert batched == alone


def test_requests_joining_at_different_steps(tiny_model_dir):
    prompts = random_prompts([9, 25, 4, 17], seed=6)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    ref = [generate_ids(make_llm(tiny_model_dir, enable_prefix_caching=False), [p], sp)[0] for p in prompts]
    engine = make_llm(tiny_model_dir).engine
    done, rids = {}, []
    for p, steps_after in zip(prompts, (3, 1, 4, 0)):
        rids.append(engine.add_request(ids_prompt(p), sp))
        for _ in range(steps_after):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    done.update(run_to_completion(engine))
    assert [done[r].outputs[0].token_ids for r in rids] == ref


def test_seeded_sample_is_batch_invariant(tiny_model_dir):
    (p,) = random_prompts([11], seed=7)
    others = random_prompts([5, 30, 2], seed=8)
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=16)
    seeded_topk = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9, max_tokens=16)
    llm = make_llm(tiny_model_dir)
    alone = generate_ids(llm, [p], seeded)[0]
    alone_k = generate_ids(llm, [p], seeded_topk)[0]
    assert generate_ids(llm, [p], seeded)[0] == alone  # same seed, same tokens
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=16), seeded, SamplingParams(max_tokens=5, **GREEDY),
                    seeded_topk, SamplingParams(temperature=1.0, seed=5, max_tokens=20)]
    outs = llm.generate([ids_prompt(x) for x in (others[0], p, others[1], p, others[2])], mixed_params)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[3].outputs[0].token_ids == alone_k
    assert alone != alone_k


# ---------------------------------------------------------------- scheduling configurations


def test_chunked_prefill_equals_unchunked(tiny_model_dir):
    prompts = random_prompts([30, 13, 3], seed=9)
    sp = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    ref = make_llm(tiny_model_dir).generate([ids_prompt(p) for p in prompts], sp)
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=8)
    sched = llm.engine.scheduler
    rows_per_step = []
    orig = sched.schedule

    def spy():
        out = orig()
        rows_per_step.append(sum(s.num_new_tokens for s in out))
        return out

    sched.schedule = spy
    outs = llm.generate([ids_prompt(p) for p in prompts], sp)
    assert max(rows_per_step) == 8 and sum(r == 8 for r in rows_per_step) >= 5  # the 30-token prompt was split
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t].logprob - db[t].logprob) <= 1e-5 for t in da)


@pytest.mark.parametrize("block_size", [16, 32])
def test_preemption_gives_same_tokens(tiny_model_dir, block_size):
    prompts = random_prompts([40, 35, 50, 20, 44], seed=10)
    params = [SamplingParams(max_tokens=40, **GREEDY)] * 4 + [SamplingParams(temperature=1.0, seed=3, max_tokens=40)]
    big = make_llm(tiny_model_dir, block_size=block_size)
    ref = [o.outputs[0].token_ids for o in big.generate([ids_prompt(p) for p in prompts], params)]
    assert big.engine.scheduler.num_preemptions == 0
    # each sequence needs up to 90 tokens; a pool of ~2 sequences forces preemption
    blocks = -(-200 // block_size)
    small = make_llm(tiny_model_dir, block_size=block_size, num_kv_blocks=blocks, max_model_len=128)
    got = [o.outputs[0].token_ids for o in small.generate([ids_prompt(p) for p in prompts], params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == ref
    assert small.engine.block_manager.num_free_blocks == blocks  # everything returned


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_caching_reuses_blocks_and_keeps_tokens(tiny_model_dir, block_size):
    (shared,) = random_prompts([70], seed=11)
    tails = random_prompts([5, 9, 1], seed=12)
    prompts = [shared + t for t in tails]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    off = make_llm(tiny_model_dir, block_size=block_size, enable_prefix_caching=False)
    ref = generate_ids(off, prompts, sp)
    assert generate_ids(off, prompts[:1], sp) == ref[:1]

    llm = make_llm(tiny_model_dir, block_size=block_size)
    engine, bm = llm.engine, llm.engine.block_manager
    full_blocks = len(shared) // block_size
    # first request: prefilled (and its prompt blocks hashed) while it keeps running
    r0 = engine.add_request(ids_prompt(prompts[0]), sp)
    engine.step()
    seq0 = engine.requests[r0][1][0]
    assert seq0.num_cached_prefix_tokens == 0
    r1 = engine.add_request(ids_prompt(prompts[1]), sp)
    engine.step()
    seq1 = engine.requests[r1][1][0]
    assert seq1.num_cached_prefix_tokens == full_blocks * block_size
    assert seq1.block_table[:full_blocks] == seq0.block_table[:full_blocks]
    assert all(bm.ref_counts[b] == 2 for b in seq0.block_table[:full_blocks])
    assert seq1.block_table[full_blocks] != seq0.block_table[full_blocks]
    done = run_to_completion(engine)
    # both finished: the shared blocks are free but keep their hashes for the next request
    r2 = engine.add_request(ids_prompt(prompts[2]), sp)
    engine.step()
    seq2 = engine.requests[r2][1][0]
    assert seq2.num_cached_prefix_tokens == full_blocks * block_size
    done.update(run_to_completion(engine))
    assert [done[r].outputs[0].token_ids for r in (r0, r1, r2)] == ref
    assert bm.num_free_blocks == bm.num_blocks
    # a fully cached prompt still computes its last token, so it still samples
    assert generate_ids(llm, [prompts[0]], sp) == ref[:1]


def test_prompt_that_fills_whole_blocks_is_cached(tiny_model_dir):
    (p,) = random_prompts([64], seed=13)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    llm = make_llm(tiny_model_dir, block_size=16)
    first = generate_ids(llm, [p], sp)
    rid = llm.engine.add_request(ids_prompt(p), sp)
    llm.engine.step()
    assert llm.engine.requests[rid][1][0].num_cached_prefix_tokens == 48  # not the block of the last token
    out = run_to_completion(llm.engine)[rid]
    assert out.outputs[0].token_ids == first[0]


# ---------------------------------------------------------------- stopping, n, logprobs


@pytest.fixture(scope="module")
def greedy_ref(tiny_model_dir):
    """A prompt and its first 24 greedy tokens (EOS ignored)."""
    (p,) = random_prompts([12], seed=14)
    toks = generate_ids(make_llm(tiny_model_dir), [p], SamplingParams(max_tokens=24, **GREEDY))[0]
    return p, toks


def test_max_tokens_and_length_reason(tiny_model_dir, greedy_ref):
    p, toks = greedy_ref
    out = make_llm(tiny_model_dir).generate(ids_prompt(p), SamplingParams(max_tokens=5, **GREEDY))[0]
    comp = out.outputs[0]
    assert comp.token_ids == toks[:5] and comp.finish_reason == "length" and comp.stop_reason is None
    assert out.finished and out.prompt_token_ids == p and comp.logprobs is None


def test_context_limit_ends_with_length(tiny_model_dir, greedy_ref):
    p, toks = greedy_ref
    llm = make_llm(tiny_model_dir, max_model_len=len(p) + 3)
    comp = llm.generate(ids_prompt(p), SamplingParams(max_tokens=None, **GREEDY))[0].outputs[0]
    assert comp.token_ids == toks[:3] and comp.finish_reason == "length"


def test_stop_token_ids(tiny_model_dir, greedy_ref):
    p, toks = greedy_ref
    i = next(j for j in range(2, len(toks)) if toks[j] not in toks[:j])
    llm = make_llm(tiny_model_dir)
    comp = llm.generate(ids_prompt(p), SamplingParams(max_tokens=24, stop_token_ids=[toks[i]], **GREEDY))[0].outputs[0]
    assert comp.token_ids == toks[: i + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == toks[i]
    # min_tokens suppresses the stop token: the continuation must then avoid it until min_tokens
    comp = llm.generate(ids_prompt(p), SamplingParams(max_tokens=24, min_tokens=i + 2, stop_token_ids=[toks[i]],
                                                      **GREEDY))[0].outputs[0]
    assert toks[i] not in comp.token_ids[: i + 2]
    assert comp.token_ids[:i] == toks[:i]
    assert len(comp.token_ids) >= i + 3 or comp.finish_reason == "length"


def test_eos_and_min_tokens(tiny_model_dir, greedy_ref, tmp_path):
    p, toks = greedy_ref
    eos = toks[0]  # make the model's favourite first token its EOS
    path = copy_checkpoint(tiny_model_dir, tmp_path / "eos-model", eos_token_id=eos)
    llm = make_llm(path)
    assert llm.engine.eos_token_ids == {eos}
    comp = llm.generate(ids_prompt(p), SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
    assert comp.token_ids == [eos] and comp.finish_reason == "stop" and comp.stop_reason is None
    comp = llm.generate(ids_prompt(p), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert comp.token_ids == toks[:10] and comp.finish_reason == "length"
    comp = llm.generate(ids_prompt(p), SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0))[0].outputs[0]
    assert eos not in comp.token_ids[:4] and len(comp.token_ids) >= 5
    assert comp.finish_reason == ("stop" if comp.token_ids[-1] == eos else "length")
    # the first step with EOS banned picks the runner-up: transformers' second-best token
    _, hf_lp, gaps = hf_greedy(tiny_model_dir, p, 1)
    second = int(hf_lp[0].topk(2).indices[1])
    assert comp.token_ids[0] == second


def test_n2_seeded_distinct(tiny_model_dir, greedy_ref):
    p, _ = greedy_ref
    llm = make_llm(tiny_model_dir)
    out = llm.generate(ids_prompt(p), SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    a, b = (c.token_ids for c in out.outputs)
    assert len(a) == len(b) == 12 and a != b
    assert all(c.finish_reason == "length" for c in out.outputs)
    one = llm.generate(ids_prompt(p), SamplingParams(temperature=1.0, seed=7, max_tokens=12))[0].outputs[0]
    assert one.token_ids == a  # sequence i of an n>1 request uses seed + i
    again = llm.generate(ids_prompt(p), SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12))[0]
    assert [c.token_ids for c in again.outputs] == [a, b]


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_structure(tiny_model_dir, greedy_ref, k):
    p, _ = greedy_ref
    llm = make_llm(tiny_model_dir)
    comp = llm.generate(ids_prompt(p), SamplingParams(temperature=1.0, seed=1, max_tokens=10, logprobs=k))[0].outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 10
    for tok, d in zip(comp.token_ids, comp.logprobs):
        assert all(isinstance(t, int) and isinstance(v, Logprob) for t, v in d.items())
        assert tok in d
        top = sorted((v for t, v in d.items() if v.rank <= k), key=lambda v: v.rank)
        assert [v.rank for v in top] == list(range(1, k + 1))
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        assert len(d) == k + (tok not in [t for t, v in d.items() if v.rank <= k])
        assert all(v.logprob <= 0 for v in d.values())
        assert sum(math.exp(v.logprob) for v in d.values()) <= 1 + 1e-5
        if k:
            assert d[tok].rank >= 1 and d[tok].logprob <= top[0].logprob


def test_generate_returns_prompt_order_and_streams(tiny_model_dir):
    prompts = random_prompts([30, 2, 15], seed=15)
    sp = [SamplingParams(max_tokens=m, **GREEDY) for m in (3, 12, 7)]
    llm = make_llm(tiny_model_dir)
    outs = llm.generate([ids_prompt(p) for p in prompts], sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 12, 7]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_generate_while_a_stream_is_open(tiny_text_model_dir):
    """generate() under an open stream() returns only its own outputs, and the stream still yields all of its
    text afterwards (before, generate raised KeyError on the stream's finished output and the stream lost it)."""
    llm = make_llm(tiny_text_model_dir, skip_tokenizer_init=False)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    alone = [llm.generate(p, sp)[0].outputs[0].text for p in ("abc", "hello world")]
    stream = llm.stream("abc", sp)
    first = next(stream)
    out = llm.generate("hello world", sp)
    assert len(out) == 1 and out[0].outputs[0].text == alone[1]
    assert first + "".join(stream) == alone[0]
    assert not llm.engine.requests and not llm._watched


def test_interrupted_generate_leaves_no_requests(tiny_model_dir, monkeypatch):
    """An exception (here Ctrl-C) inside generate's step loop aborts its requests and frees their blocks; the next
    generate runs normally (before, the leftovers made it raise KeyError)."""
    llm = make_llm(tiny_model_dir)
    prompts = [ids_prompt(p) for p in random_prompts([5, 7], seed=30)]
    sp = SamplingParams(max_tokens=20, **GREEDY)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    free0 = llm.engine.block_manager.num_free_blocks
    real, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, sp)
    monkeypatch.undo()
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests() and not llm._watched
    assert llm.engine.block_manager.num_free_blocks == free0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == expected


def test_interrupt_inside_an_overlapped_step_aborts_its_requests(tiny_text_model_dir, monkeypatch):
    """Ctrl-C while the host waits for a queued step's picks (overlapped greedy decode: the next step is already
    queued, this one's tokens not yet appended) aborts every request in flight, an open stream's too: the stream
    raises instead of going on from a half-updated sequence; blocks are freed and later requests are exact."""
    from sparrow import switches
    from sparrow.engine.step_plan import StepResult

    assert switches.OVERLAP
    llm = make_llm(tiny_text_model_dir, skip_tokenizer_init=False)
    sp = SamplingParams(max_tokens=20, **GREEDY)
    alone = llm.generate("abc", sp)[0].outputs[0].text
    free0 = llm.engine.block_manager.num_free_blocks
    stream = llm.stream("abc", sp)
    got = next(stream) + next(stream)
    real, calls = StepResult.token_ids, []

    def tolist(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(StepResult, "token_ids", tolist)
    with pytest.raises(KeyboardInterrupt):
        llm.generate("hello world", sp)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="aborted"):
        for piece in stream:  # the text of the steps that completed, then the error
            got += piece
    assert alone.startswith(got) and len(got) < len(alone)
    assert not llm.engine.requests and not llm._watched and llm.engine._ahead is None
    assert llm.engine.block_manager.num_free_blocks == free0
    assert llm.generate("abc", sp)[0].outputs[0].text == alone


def test_stream_pieces_join_to_the_final_text_with_stop_strings(tiny_text_model_dir):
    """stream() holds back len(longest stop string) - 1 characters until the request finishes, so text that a
    stop string later removes is never sent (vLLM's output processor does the same)."""
    llm = make_llm(tiny_text_model_dir, skip_tokenizer_init=False)
    full = llm.generate("abc", SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].text
    checked, incremental = 0, False
    for i in range(2, len(full) - 3):
        stop = full[i:i + 3]
        if full.find(stop) != i:
            continue
        sp = SamplingParams(max_tokens=24, stop=[stop, "\x00\x01never"], **GREEDY)
        final = llm.generate("abc", sp)[0].outputs[0].text
        assert final == full[:i]
        pieces = list(llm.stream("abc", sp))
        assert "".join(pieces) == final, (stop, pieces)
        edited = SamplingParams(max_tokens=24, **GREEDY)
        edited.stop = [stop]  # set after construction: the request's validated copy decides the hold-back
        assert "".join(llm.stream("abc", edited)) == final
        checked += 1
        incremental |= len(pieces) > 1
    assert checked >= 3 and incremental, (full, checked)
    assert not llm.engine.requests and not llm._watched


def test_abort_frees_blocks(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    rid = engine.add_request(ids_prompt(random_prompts([40], seed=16)[0]), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.block_manager.num_free_blocks < free0
    engine.abort(rid)
    assert engine.block_manager.num_free_blocks == free0 and not engine.has_unfinished_requests()
