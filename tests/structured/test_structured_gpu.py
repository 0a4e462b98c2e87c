"""Structured output on the GPU: the token bitmask applied to logits that a CUDA graph replay produced (decode
steps of the tiny random Llama run in captured graphs) and to an eager prefill's, in batches mixing every
constraint with unconstrained rows, greedy and seeded random (n > 1). Each output is checked by the oracles of
``test_engine_structured`` (jsonschema, json.loads, re.fullmatch, the choice list, xgrammar's own matcher)."""
from __future__ import annotations

import pytest

from sparrow import LLM, SamplingParams
from tests.structured.test_engine_structured import CONSTRAINTS, check, check_mixed_batch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_llm(request, tiny_eos_model_dir):
    return LLM(str(tiny_eos_model_dir), device="cuda", dtype=request.param, max_model_len=256, num_kv_blocks=64,
               block_size=16)


def test_graph_replay_rows_take_the_bitmask(cuda_llm):
    """Greedy rows of every constraint beside unconstrained rows; the decode steps replay captured graphs."""
    assert cuda_llm.engine.runner.graphs is not None
    check_mixed_batch(cuda_llm)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_random_samples_on_cuda_are_valid(cuda_llm, kind):
    out = cuda_llm.generate(["hi"], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=48,
                                                   structured_outputs=CONSTRAINTS[kind]))[0]
    for comp in out.outputs:
        check(kind, comp, cuda_llm.get_tokenizer())
