"""Speculative decoding on the two packaged real models (Gemma 3 270M Q4_K_M, SmolLM2-135M-Instruct Q4_1), fp32
on CPU: greedy output with n-gram speculation and with a draft model (the model drafting for itself) equals
plain decoding's on repetitive text and code; a model drafting for itself has its drafts accepted.

Tokens are compared up to the first step where plain decoding's top-2 logprob gap is under GAP (a near-tie the
verify rows, computed in a different batch shape, may break the other way).
"""
from __future__ import annotations

import pytest

from sparrow import LLM, SamplingParams
from tests.models.test_packaged_models import MODELS

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. Again: the quick brown fox jumps over the",
    "def area(width, height):\n    return width * height\n\n\n# The same function, with w and h:\n"
    "def area(w, h):\n",
]
NEW_TOKENS = 20
GAP = 1e-3
SPECS = {
    "ngram": lambda path: {"method": "ngram", "num_speculative_tokens": 4},
    "self-draft": lambda path: {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    path = MODELS[request.param]()
    plain = LLM(str(path), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)
    return path, params, plain.generate(PROMPTS, params)


def trusted(logprobs) -> int:
    """Steps of plain decoding before its first near-tie."""
    for i, d in enumerate(logprobs):
        top = sorted((lp.logprob for lp in d.values()), reverse=True)
        if top[0] - top[1] < GAP:
            return i
    return len(logprobs)


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_speculation_equals_plain_decoding(model, method):
    path, params, ref = model
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=SPECS[method](path))
    got = llm.generate(PROMPTS, params)
    compared = 0
    for r, g in zip(ref, got):
        n = trusted(r.outputs[0].logprobs)
        assert g.outputs[0].token_ids[:n] == r.outputs[0].token_ids[:n]
        compared += n
    assert compared >= NEW_TOKENS  # most steps are far from a tie
    m = llm.get_metrics()
    drafts, accepted = m["sparrow:spec_decode_num_draft_tokens"], m["sparrow:spec_decode_num_accepted_tokens"]
    assert accepted > 0
    if method == "self-draft":
        assert accepted >= 0.9 * drafts, f"a model drafting for itself: {accepted} of {drafts} drafts accepted"
