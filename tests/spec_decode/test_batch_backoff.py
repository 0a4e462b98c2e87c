"""The decoder's per-step rule (sparrow/spec_decode/decoder.py): a step verifies its drafts only when the tokens
it expects to gain pay for the verify step's measured cost; otherwise drafting pauses (4, 8 .. 32 steps), the
engine may overlap those steps, and after the longest pause one verify step runs regardless."""
from __future__ import annotations

from sparrow import SamplingParams, switches
from sparrow.config import SpeculativeConfig
from sparrow.engine.sequence import Sequence
from sparrow.engine.step_plan import ScheduledSeq
from sparrow.spec_decode.decoder import FIRST_HOLD_STEPS, INITIAL_RATE, MAX_BACKOFF_STEPS, SpeculativeDecoder

K = 4


class FixedProposer:
    """Drafts K tokens for the sequences in ``drafting``, none for the others."""

    def __init__(self):
        self.drafting: set = set()

    def propose(self, requests):
        return [[1] * k if seq in self.drafting else [] for seq, k in requests]

    def release(self, seq):
        pass


def _decoding(n: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(max_tokens=1000), set())
        s.output_token_ids = [4]
        s.num_computed_tokens = s.num_tokens - 1
        seqs.append(s)
    return seqs


def _decoder():
    proposer = FixedProposer()
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": K})
    return SpeculativeDecoder(config, proposer, max_model_len=4096), proposer


def _decode_step(dec, seqs, seconds: float = 1.0e-3) -> None:
    """One plain decode step: a token for every sequence, timed."""
    for s in seqs:
        s.output_token_ids.append(4)
        s.num_computed_tokens += 1
    dec.observe_step(1, seconds, len(seqs))


def _measure(dec, t1: float, tq: float, batch: int) -> None:
    dec.observe_step(1, t1, batch)
    dec.observe_step(K + 1, tq, batch)


def test_unmeasured_costs_verify():
    dec, prop = _decoder()
    seqs = _decoding(8)
    prop.drafting = {seqs[0]}
    assert list(dec.propose(seqs)) == [seqs[0]]


def test_few_drafted_sequences_in_a_costly_step_are_dropped_then_paused():
    dec, prop = _decoder()
    seqs = _decoding(8)
    _measure(dec, 1.0e-3, 3.0e-3, len(seqs))  # a verify step costs 3 decode steps: it must gain 2 tokens per sequence
    prop.drafting = set(seqs[:2])  # expected gain 2 * 4 * 0.7 = 5.6 < 2 * 8
    assert dec.propose(seqs) == {}
    assert dec.paused(seqs)  # the engine may queue decode steps ahead
    for _ in range(FIRST_HOLD_STEPS - 1):
        _decode_step(dec, seqs)
        assert dec.propose(seqs) == {}
    _decode_step(dec, seqs)
    prop.drafting = set(seqs)  # every sequence drafts: gain 8 * 4 * 0.7 = 22.4 >= 16
    assert set(dec.propose(seqs)) == set(seqs)
    assert not dec.paused(seqs)


def test_a_cheap_verify_step_pays_for_one_draft():
    dec, prop = _decoder()
    seqs = _decoding(1)
    _measure(dec, 1.0e-3, 1.3e-3, len(seqs))
    prop.drafting = set(seqs)
    assert set(dec.propose(seqs)) == set(seqs)


def test_rates_come_from_verified_drafts():
    dec, prop = _decoder()
    seqs = _decoding(2)
    _measure(dec, 1.0e-3, 2.0e-3, len(seqs))  # must gain 1 token per sequence: 2 in all
    good, bad = seqs
    for _ in range(20):  # `bad` keeps getting none of its drafts accepted
        dec.record(ScheduledSeq(bad, bad.num_computed_tokens, K + 1, num_sampled=K + 1, draft_token_ids=[1] * K), 0)
    prop.drafting = {bad}
    assert dec.propose(seqs) == {}  # 4 * rate(bad) ~ 0 < 2
    assert dec._rate[bad] < 0.01 and dec._rate.get(good, INITIAL_RATE) == INITIAL_RATE


def test_pauses_double_and_the_longest_ends_with_one_verify_step():
    dec, prop = _decoder()
    seqs = _decoding(8)
    _measure(dec, 1.0e-3, 10.0e-3, len(seqs))  # never pays
    prop.drafting = {seqs[0]}
    holds = []
    for _ in range(200):
        out = dec.propose(seqs)
        if out:
            break
        holds.append(dec._hold)
        for _ in range(dec._hold):
            _decode_step(dec, seqs)
    else:
        raise AssertionError("no verify step after the longest pause")
    assert holds == [4, 8, 16, 32]
    assert out == {seqs[0]: [1] * K} and MAX_BACKOFF_STEPS == 32


def test_a_pause_of_the_caller_is_not_a_slow_step():
    dec, _ = _decoder()
    dec.observe_step(1, 1.0e-3)
    dec.observe_step(1, 5.0)  # the caller paused between two steps
    assert dec.step_seconds[1, 1] <= 1.0e-3 * (1 + 0.25 * 3) + 1e-12


def test_sequences_without_an_ngram_match_let_the_engine_overlap():
    """With the n-gram proposer, a sequence whose tokens so far repeat no n-gram counts as paused (the engine
    may queue its next step ahead); one whose last tokens occurred before does not."""
    from sparrow.spec_decode.ngram import NgramProposer

    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                                          "prompt_lookup_max": 3})
    dec = SpeculativeDecoder(config, NgramProposer(2, 3), max_model_len=4096)
    fresh = Sequence("a", 0, [10, 11, 12, 13], SamplingParams(max_tokens=100), set())
    fresh.output_token_ids = [14]
    repeat = Sequence("b", 0, [10, 11, 12, 13, 10], SamplingParams(max_tokens=100), set())
    repeat.output_token_ids = [11]  # ... 10, 11 occurred before, followed by 12
    assert dec.paused([fresh])
    assert not dec.paused([repeat]) and not dec.paused([fresh, repeat])
    assert dec.proposer.propose([(repeat, K)]) == [[12, 13, 10, 11]]


def test_step_costs_are_kept_per_batch_bucket():
    """A verify step that is cheap at batch 1 and costly at batch 8: each batch decides on its own costs."""
    dec, prop = _decoder()
    one, eight = _decoding(1), _decoding(8)
    _measure(dec, 1.0e-3, 1.3e-3, 1)
    _measure(dec, 1.0e-3, 5.0e-3, 8)  # at batch 8 a verify step must gain 4 tokens per sequence
    prop.drafting = set(one) | {eight[0]}
    assert set(dec.propose(one)) == set(one)
    assert dec.propose(eight) == {}
    assert sorted(dec.step_seconds) == [(1, 1), (1, K + 1), (8, 1), (8, K + 1)]


def test_closed_batch_verifies_only_when_every_longest_sequence_gains(monkeypatch):
    """SPEC_CLOSED_BATCH, no request waiting: each sequence with the most tokens left (within k) must draft and
    gain the step's cost; a sequence near its max_tokens does not count; with a request waiting the gains sum."""
    monkeypatch.setattr(switches, "SPEC_CLOSED_BATCH", True)
    dec, prop = _decoder()
    seqs = _decoding(8)
    _measure(dec, 1.0e-3, 3.0e-3, len(seqs))  # cost: 2 tokens per sequence
    prop.drafting = set(seqs[:7])  # summed: 7 * 4 * 0.7 = 19.6 >= 16 would verify
    assert dec.propose(seqs, waiting=1) != {}
    dec._hold_until = 0
    assert dec.propose(seqs) == {}  # the eighth sequence, as long as the rest, gains nothing
    dec._hold, dec._hold_until = 0, 0
    seqs[7].params = SamplingParams(max_tokens=len(seqs[7].output_token_ids) + 2)  # ends in 2 tokens
    assert set(dec.propose(seqs)) == set(seqs[:7])  # 2.8 >= 2 for each of the longest
    prop.drafting = set(seqs)
    for s in seqs[:7]:  # the longest sequences' acceptance falls: 4 * 0.3 < 2
        dec._rate[s] = 0.3
    assert dec.propose(seqs) == {}


def test_closed_batch_off_sums_the_gains(monkeypatch):
    monkeypatch.setattr(switches, "SPEC_CLOSED_BATCH", False)
    dec, prop = _decoder()
    seqs = _decoding(8)
    _measure(dec, 1.0e-3, 3.0e-3, len(seqs))
    prop.drafting = set(seqs[:7])
    assert set(dec.propose(seqs)) == set(seqs[:7])
