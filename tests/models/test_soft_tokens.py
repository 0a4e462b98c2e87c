"""Soft-token injection (how multimodal encoders feed the decoder): a prompt
``{"prompt_token_ids", "soft_embeds" [n, H], "soft_positions"}`` takes the given vectors, unscaled, at those
positions instead of embedding-table rows.

- soft_embeds equal to the (scaled, for Gemma) table rows of the prompt's own ids give exactly the plain
  prompt's output;
- other vectors give transformers' ``inputs_embeds`` path (``generate(inputs_embeds=...)`` with the same
  rows replaced): ids up to the first near-tie (top-2 gap < 1e-4), logprobs within 1e-4; alone and batched
  next to plain prompts.
"""
from __future__ import annotations

import pytest
import torch

from sparrow import SamplingParams
from tests.helpers import make_llm
from tests.models._hf_tiny import DENSE, FAMILIES, build, compare, hf_greedy, prompts

NEW = 16
PROMPTS = prompts((7, 21))
POSITIONS = [1, 2, 3, 9]
CASES = {"gemma4": FAMILIES, "qwen3_moe": FAMILIES, "llama": DENSE, "gemma3": DENSE}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("soft") / request.param
    hf = build(CASES[request.param], request.param, path)
    return path, hf, make_llm(path, max_model_len=128)


def _params():
    return SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)


def _soft_prompt(p, vecs, positions):
    return {"prompt_token_ids": p, "soft_embeds": vecs, "soft_positions": positions}


def test_table_rows_as_soft_embeds_equal_the_plain_prompt(case):
    path, hf, llm = case
    p = PROMPTS[1]
    with torch.no_grad():
        rows = hf.get_input_embeddings()(torch.tensor([p]))[0]  # scaled for Gemma, as sparrow's table lookup
    plain = llm.generate({"prompt_token_ids": p}, _params())[0].outputs[0]
    soft = llm.generate(_soft_prompt(p, rows[POSITIONS].clone(), POSITIONS), _params())[0].outputs[0]
    assert soft.token_ids == plain.token_ids
    for a, b in zip(soft.logprobs, plain.logprobs):
        for tok in a:
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-5


def test_other_vectors_match_transformers_inputs_embeds(case):
    path, hf, llm = case
    g = torch.Generator().manual_seed(3)
    requests, refs = [], []
    for p in PROMPTS:
        positions = [q for q in POSITIONS if q < len(p)]
        with torch.no_grad():
            embeds = hf.get_input_embeddings()(torch.tensor([p]))[0].clone()
        vecs = torch.randn(len(positions), embeds.shape[1], generator=g) * float(embeds.std())
        embeds[positions] = vecs
        refs.append(hf_greedy(hf, None, NEW, inputs_embeds=embeds))
        requests.append(_soft_prompt([0 if i in positions else t for i, t in enumerate(p)], vecs, positions))
    compared = sum(compare(ids, logits, llm.generate(req, _params())[0].outputs[0])
                   for req, (ids, logits) in zip(requests, refs))
    assert compared >= NEW, f"only {compared} steps free of near-ties"
    # batched, next to a plain prompt
    outs = llm.generate(requests + [{"prompt_token_ids": PROMPTS[0]}], _params())
    for (ids, logits), o in zip(refs, outs):
        compare(ids, logits, o.outputs[0])
