"""Dense architectures from tiny random HF safetensors checkpoints (Llama, Qwen2 with q/k/v bias, Qwen3 with
q/k norms, Mistral with an 8-token window, Gemma 3 with sliding + full layers and a soft-cap), against
transformers' ``generate`` on the same weights, CPU fp32: ids up to the first near-tie (top-2 gap < 1e-4),
logprobs within 1e-4, one prompt at a time and as one mixed-length batch."""
from __future__ import annotations

import pytest

from sparrow import SamplingParams
from tests.helpers import make_llm
from tests.models._hf_tiny import DENSE, build, compare, hf_greedy, prompts

NEW = 16
PROMPTS = prompts()


@pytest.fixture(scope="module", params=list(DENSE))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("dense") / request.param
    hf = build(DENSE, request.param, path)
    return path, [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_greedy_matches_transformers(case):
    path, ref = case
    llm = make_llm(path, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
    compared = 0
    for p, (ids, logits) in zip(PROMPTS, ref):
        compared += compare(ids, logits, llm.generate({"prompt_token_ids": p}, params)[0].outputs[0])
    assert compared >= 0.5 * NEW * len(PROMPTS), f"only {compared} steps free of near-ties"
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for (ids, logits), o in zip(ref, batch):
        compare(ids, logits, o.outputs[0])
