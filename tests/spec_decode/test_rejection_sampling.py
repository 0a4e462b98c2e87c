"""Speculative sampling keeps the target's distribution: with a deliberately different draft model, the empirical
distribution of the third generated token over many seeded samples matches the target's exact marginal,
computed by transformers fp32 with transformers' own logits processors (repetition penalty, temperature,
top-k) by enumerating the first two tokens.

Statistical test: Pearson's chi-square over the tokens (cells with an expected count below 5 merged), p-value
from the chi-square survival function; the test fails below P_MIN. Its power is shown on the same samples: the
statistic against the draft model's marginal (what accepting every draft would give) has p < 1e-6.
"""
from __future__ import annotations

import itertools

import torch

from sparrow import SamplingParams
from tests.helpers import build_tiny_llama, ids_prompt, make_llm
from tests.spec_decode.test_spec_engine import noisy_copy

VOCAB = 16
SAMPLES = 2000
P_MIN = 1e-3
PROMPT = [3, 1, 4, 1, 5]
PARAMS = dict(temperature=0.8, top_k=10, repetition_penalty=1.3)


@torch.no_grad()
def marginal_of_third_token(path) -> torch.Tensor:
    """[V] P(t3) under transformers' model at ``path`` with PARAMS applied, t1 and t2 summed out."""
    import transformers
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper)

    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(PARAMS["repetition_penalty"]),
                                 TemperatureLogitsWarper(PARAMS["temperature"]), TopKLogitsWarper(PARAMS["top_k"])])

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(contexts)
        logits = model(ids).logits[:, -1].float()
        return torch.softmax(procs(ids, logits), dim=-1)

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(VOCAB)])                       # [V, V]: t1 -> t2
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = next_probs([PROMPT + [a, b] for a, b in pairs]).view(VOCAB, VOCAB, VOCAB)  # t1, t2 -> t3
    return torch.einsum("a,ab,abc->c", p1.double(), p2.double(), p3.double())


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` [V] against ``probs`` [V], cells with expected < 5 merged."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    target = build_tiny_llama(tmp_path / "target", seed=5, vocab_size=VOCAB, initializer_range=0.3)
    draft = noisy_copy(target, tmp_path / "draft", scale=0.2)
    llm = make_llm(target, max_model_len=32, max_num_seqs=256,
                   speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    out = llm.generate(ids_prompt(PROMPT), SamplingParams(n=SAMPLES, seed=11, max_tokens=3, ignore_eos=True,
                                                          **PARAMS))[0]
    m = llm.get_metrics()
    drafts, accepted = m["sparrow:spec_decode_num_draft_tokens"], m["sparrow:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafts  # drafts are verified, some accepted and some rejected
    third = torch.tensor([c.token_ids[2] for c in out.outputs])
    counts = torch.bincount(third, minlength=VOCAB)
    p_target = chi_square_p(counts, marginal_of_third_token(target))
    p_draft = chi_square_p(counts, marginal_of_third_token(draft))
    assert p_target > P_MIN, f"chi-square p = {p_target:.2e} against the target's distribution"
    assert p_draft < 1e-6, f"the test cannot tell the draft's distribution apart (p = {p_draft:.2e})"
