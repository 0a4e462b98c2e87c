"""Sampler tests. Oracles: torch.argmax / log_softmax, transformers' LogitsProcessors (repetition penalty,
temperature, top-k, top-p, min-p), a per-row torch reimplementation of the frequency / presence penalties,
and chi-square goodness of fit for the draws.

Run as a script for a micro-benchmark: ``python tests/engine/test_sampler.py``.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sparrow.engine.sampler import (
    Sampler,
    SamplingState,
    apply_penalties,
    make_generator,
    truncate,
)
from sparrow.sampling_params import SamplingParams as SP

ROWS = [1, 2, 3, 16, 17]


def state(params: SP, prompt=(), out=(), eos=(0,), index: int = 0) -> SamplingState:
    gen = make_generator(params.seed, index, "cpu") if params.seed is not None else None
    return SamplingState(params, list(prompt), list(out), gen, set(eos))


def hf_filter(logits: torch.Tensor, t: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """[1, V] logits -> HF's warped scores (-inf where filtered), in generate()'s order."""
    scores = TemperatureLogitsWarper(t)(None, logits.clone())
    if k > 0:
        scores = TopKLogitsWarper(k)(None, scores)
    if p < 1.0:
        scores = TopPLogitsWarper(p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


def oracle_penalties(logits: torch.Tensor, st: SamplingState) -> torch.Tensor:
    """[V] -> penalized [V]: HF's repetition processor, then a plain loop for frequency / presence."""
    p = st.params
    x = logits.clone()[None]
    ids = st.prompt_token_ids + st.output_token_ids
    if p.repetition_penalty != 1.0 and ids:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), x)
    x = x[0]
    for t in set(st.output_token_ids):
        c = st.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    if len(st.output_token_ids) < p.min_tokens:
        for t in st.eos_token_ids | set(p.stop_token_ids or ()):
            x[t] = float("-inf")
    return x


@pytest.mark.parametrize("R", ROWS)
@pytest.mark.parametrize("V", [7, 1000])
def test_greedy_is_argmax(R, V):
    torch.manual_seed(R * V)
    logits = torch.randn(R, V)
    before = logits.clone()
    out = Sampler(0)(logits, [state(SP(temperature=0.0)) for _ in range(R)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * R
    torch.testing.assert_close(logits, before, atol=0, rtol=0)   # the caller's logits stay untouched


def test_greedy_ties_take_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert Sampler(0)(logits, [state(SP(temperature=0.0))]).token_ids == [1]


def test_greedy_rows_in_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    params = [SP(temperature=0.0), SP(temperature=1.0, seed=1), SP(temperature=0.0),
              SP(temperature=0.5, top_p=0.5), SP(temperature=0.0, min_p=0.5)]
    out = Sampler(0)(logits, [state(p) for p in params])
    for r in (0, 2, 4):
        assert out.token_ids[r] == int(logits[r].argmax())


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_are_raw_log_softmax_with_ranks(n):
    torch.manual_seed(n)
    R, V = 4, 500
    logits = torch.randn(R, V) * 2
    params = [SP(temperature=0.0, logprobs=n), SP(temperature=0.8, top_k=20, logprobs=n, seed=3),
              SP(temperature=1.0, logprobs=None), SP(temperature=1.2, repetition_penalty=1.5,
                                                    frequency_penalty=1.0, logprobs=n, seed=4)]
    states = [state(p, prompt=[1, 2, 3], out=[4, 5, 5]) for p in params]
    out = Sampler(0)(logits, states)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for r in (0, 1, 3):
        d = out.logprobs[r]
        tok = out.token_ids[r]
        top = torch.topk(ref[r], n).indices.tolist() if n else []
        assert set(d) == set(top) | {tok}
        for t, (lp, rank) in d.items():
            assert lp == pytest.approx(float(ref[r, t]), abs=1e-5)
            assert rank == 1 + int((ref[r] > ref[r, t]).sum())


def test_logprob_ranks_with_ties():
    logits = torch.tensor([[1.0, 1.0, 2.0, 0.0, 1.0]])
    out = Sampler(0)(logits, [state(SP(temperature=0.0, logprobs=4))])
    d = out.logprobs[0]
    assert out.token_ids == [2]
    assert d[2][1] == 1
    assert sorted(rank for t, (_, rank) in d.items() if t != 2) == [2, 2, 2]


@pytest.mark.parametrize(
    "kw",
    [dict(repetition_penalty=1.7), dict(repetition_penalty=0.6), dict(frequency_penalty=1.5),
     dict(presence_penalty=-1.2), dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4),
     dict(min_tokens=5, stop_token_ids=[9, 11])],
)
def test_penalties_match_oracle(kw):
    torch.manual_seed(7)
    R, V = 3, 64
    logits = torch.randn(R, V) * 3
    states = [state(SP(temperature=0.0, **kw), prompt=random.Random(r).choices(range(V), k=10),
                    out=random.Random(r + 9).choices(range(V), k=4 + r), eos={0, 3}) for r in range(R)]
    got = apply_penalties(logits.clone(), states)
    for r in range(R):
        torch.testing.assert_close(got[r], oracle_penalties(logits[r], states[r]), atol=1e-6, rtol=0)
    out = Sampler(0)(logits, states)
    assert out.token_ids == [int(oracle_penalties(logits[r], states[r]).argmax()) for r in range(R)]


def test_penalties_count_output_only():
    # frequency / presence see only output tokens: a prompt-only token keeps its logit
    logits = torch.zeros(1, 8)
    st = state(SP(frequency_penalty=1.0, presence_penalty=0.5), prompt=[1, 1, 2], out=[2, 3, 3])
    got = apply_penalties(logits.clone(), [st])[0]
    assert got.tolist() == [0.0, 0.0, -1.5, -2.5, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_suppresses_eos_and_stop_tokens(temperature):
    logits = torch.full((1, 10), -5.0)
    logits[0, 2] = 20.0  # EOS
    logits[0, 7] = 19.0  # stop token
    p = SP(temperature=temperature, min_tokens=3, stop_token_ids=[7], seed=0)
    s = Sampler(0)
    for n_out in range(3):
        tok = s(logits, [state(p, out=[5] * n_out, eos={2})]).token_ids[0]
        assert tok not in (2, 7)
    # once min_tokens are out, EOS / stop tokens come back (they hold ~all the mass)
    assert s(logits, [state(p, out=[5] * 3, eos={2})]).token_ids[0] in ((2,) if temperature == 0 else (2, 7))
    # ignore_eos does not lift the min_tokens suppression either
    q = SP(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert s(logits, [state(q, out=[5], eos={2})]).token_ids[0] not in (2,)


@pytest.mark.parametrize("R", ROWS)
def test_top_k_1_equals_greedy(R):
    torch.manual_seed(R)
    logits = torch.randn(R, 2000)
    params = [SP(temperature=random.Random(r).uniform(0.2, 2.0), top_k=1, seed=r if r % 2 else None,
                 top_p=0.9 if r % 3 == 0 else 1.0) for r in range(R)]
    out = Sampler(0)(logits, [state(p) for p in params])
    assert out.token_ids == logits.argmax(-1).tolist()


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 10, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.2), (0.5, 40, 0.8, 0.0),
    (1.0, 100, 0.95, 0.05), (2.0, 0, 0.99, 0.0), (0.9, 3000, 0.7, 0.0), (1.0, 0, 0.3, 0.3), (1.0, 1, 0.5, 0.5),
]


@pytest.mark.parametrize("max_candidates", [16, 1024])   # 16 forces the full-sort fallback of top-p
@pytest.mark.parametrize("V", [300, 5000])
def test_truncate_matches_hf_warpers(V, max_candidates):
    torch.manual_seed(V + max_candidates)
    cases = [c for c in CASES if c[1] > 0 or c[2] < 1.0]
    S = len(cases)
    logits = torch.randn(S, V) * torch.linspace(0.5, 4.0, S)[:, None]
    t = torch.tensor([c[0] for c in cases])
    cand = truncate(logits, t, torch.tensor([c[1] for c in cases]), torch.tensor([c[2] for c in cases]),
                    torch.tensor([c[3] for c in cases]), max_candidates=max_candidates)
    for i, (temp, k, p, mp) in enumerate(cases):
        hf = hf_filter(logits[i : i + 1], temp, k, p, mp)[0]
        n = int(cand.count[i])
        kept = cand.ids[i, :n]
        assert set(kept.tolist()) == set(torch.isfinite(hf).nonzero().flatten().tolist()), cases[i]
        # candidates are sorted, scaled logits, and renormalized they are HF's distribution
        torch.testing.assert_close(cand.logits[i, :n], logits[i, kept] / temp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(torch.softmax(cand.logits[i, :n], -1), torch.softmax(hf, -1)[kept],
                                   atol=1e-6, rtol=1e-5)


def test_min_p_without_truncation_matches_hf():
    torch.manual_seed(3)
    logits = torch.randn(1, 50) * 3
    hf = hf_filter(logits, 0.8, 0, 1.0, 0.3)[0]
    allowed = set(torch.isfinite(hf).nonzero().flatten().tolist())
    p = SP(temperature=0.8, min_p=0.3)
    seen = set(Sampler(0)(logits.expand(4000, -1), [state(p)] * 4000).token_ids)
    assert seen <= allowed and len(seen) == len(allowed)


def _steps(seed_params: SP, n_steps: int, others: list[SP], order_seed: int, V: int = 3000):
    """Samples the seeded row n_steps times inside a batch with `others`, shuffled; returns its tokens."""
    torch.manual_seed(0)
    all_logits = [torch.randn(V) * 2.5 for _ in range(n_steps)]
    st = state(seed_params, prompt=[1, 2, 3])
    other_states = [state(p, prompt=[4]) for p in others]
    sampler = Sampler(order_seed)
    rng = random.Random(order_seed)
    tokens = []
    for step in range(n_steps):
        rows = [st] + other_states
        rng.shuffle(rows)
        logits = torch.randn(len(rows), V)
        logits[rows.index(st)] = all_logits[step]
        tok = sampler(logits, rows).token_ids[rows.index(st)]
        tokens.append(tok)
        st.output_token_ids.append(tok)
        for o in other_states:
            o.output_token_ids.append(0)
    return tokens


@pytest.mark.parametrize(
    "params",
    [SP(temperature=1.0, seed=11), SP(temperature=0.9, top_p=0.9, seed=12), SP(temperature=1.1, top_k=50, seed=13),
     SP(temperature=0.8, min_p=0.05, top_k=500, top_p=0.95, repetition_penalty=1.2, seed=14)],
)
def test_seeded_row_is_batch_invariant(params):
    others = [SP(temperature=1.0), SP(temperature=0.0), SP(temperature=0.7, top_k=5, seed=99),
              SP(temperature=1.5, top_p=0.8), SP(temperature=1.0, top_k=2000, seed=3)]
    alone = _steps(params, 12, [], order_seed=1)
    assert len(set(alone)) > 1   # it really samples
    for order_seed in (2, 3):
        assert _steps(params, 12, others, order_seed=order_seed) == alone


def test_make_generator_streams():
    a = torch.rand(4, generator=make_generator(5, 0, "cpu"))
    b = torch.rand(4, generator=torch.Generator().manual_seed(5))
    c = torch.rand(4, generator=make_generator(5, 1, "cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    m = exp > 0
    assert counts[~m].sum() == 0, "drew a token of probability 0"
    return float(((counts[m] - exp[m]) ** 2 / exp[m]).sum())


@pytest.mark.parametrize(
    "params",
    [SP(temperature=0.7), SP(temperature=1.0, top_p=0.8), SP(temperature=1.3, top_k=4),
     SP(temperature=1.0, min_p=0.15), SP(temperature=1.0, seed=0)],
)
def test_draws_follow_the_distribution(params):
    V, N = 8, 24000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    expected = torch.softmax(hf_filter(logits, params.temperature, params.top_k, params.top_p, params.min_p), -1)[0]
    sampler = Sampler(1234)
    if params.seed is None:
        states = [state(params)] * 2000
        toks = sum((sampler(logits.expand(2000, -1), states).token_ids for _ in range(N // 2000)), [])
    else:  # many seeded sequences: each its own generator
        toks = sampler(logits.expand(N, -1), [state(params, index=i) for i in range(N)]).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=V).float()
    # chi-square with <= 7 degrees of freedom: P(stat > 40) < 1e-5
    assert _chi2(counts, expected) < 40.0, (counts / N, expected)


def test_rejects_mismatched_states():
    with pytest.raises(ValueError, match="sampling states"):
        Sampler()(torch.zeros(2, 5), [state(SP())])


def _bench() -> None:
    torch.manual_seed(0)
    R, V = 8, 262144
    peaked = torch.randn(R, V) * 2
    peaked[:, :200] += torch.randn(R, 200) * 3 + 8
    mixed = [SP(temperature=0), SP(temperature=0.8, top_p=0.95), SP(temperature=1.0, top_k=50),
             SP(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05), SP(temperature=1.0),
             SP(temperature=1.0, min_p=0.1, seed=3),
             SP(temperature=0.6, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.5, seed=5, logprobs=5),
             SP(temperature=0, logprobs=20)]
    states = [state(p, prompt=range(1000, 3000), out=range(200)) for p in mixed]
    greedy = [state(SP(temperature=0.0), prompt=[1], out=[2]) for _ in range(R)]
    sampler = Sampler(0)
    for name, x, st in [("greedy, R=8", peaked, greedy), ("mixed, R=8, peaked logits", peaked, states),
                        ("mixed, R=8, flat randn*3 logits (big nucleus)", torch.randn(R, V) * 3, states)]:
        sampler(x, st)
        t0 = time.perf_counter()
        for _ in range(10):
            sampler(x, st)
        print(f"{name:48s} V={V}: {(time.perf_counter() - t0) / 10 * 1e3:7.2f} ms/step")


if __name__ == "__main__":
    _bench()
