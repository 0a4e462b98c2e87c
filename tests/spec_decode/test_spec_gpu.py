"""Speculative decoding on CUDA (skipped without a GPU): a verify step whose sequences have fewer rows than the
captured q replays that graph with the short sequences padded, and its logits equal the eager forward's; greedy
speculation with CUDA graphs gives plain decoding's tokens on a tiny Llama in fp32."""
from __future__ import annotations

import pytest
import torch

from sparrow import SamplingParams
from sparrow.engine.step_plan import ScheduledSeq, StepPlan
from tests.engine.test_step_plan import _logits, _prefilled
from tests.spec_decode.test_spec_engine import PROMPTS
from tests.helpers import build_tiny_llama, generate_ids, make_llm, random_prompts, tiny_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu


def test_short_sequences_are_padded_into_the_verify_graph(tiny_model_dir):
    from sparrow.engine.model_runner import ModelRunner

    engine = make_llm(tiny_model_dir, device="cuda", max_num_seqs=4).engine
    runner = ModelRunner(engine.config, engine.runner.model, query_lens=(1, 4))
    seqs = [_prefilled(engine, p, runner) for p in random_prompts([9, 21, 5], seed=40)]
    drafts = random_prompts([0, 1, 3], seed=41)
    plan = StepPlan([ScheduledSeq(s, s.num_computed_tokens, 1 + len(d), num_sampled=1 + len(d), draft_token_ids=d)
                     for s, d in zip(seqs, drafts)])
    eager = _logits(engine, plan, runner)
    replays = []
    real = runner.graphs.run
    runner.graphs.run = lambda *a, **k: replays.append(a[:2]) or real(*a, **k)
    assert runner.run(plan).token_ids() == eager.argmax(-1).tolist()
    assert replays == [(3, 4)]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                  "draft"])
def test_greedy_speculation_with_graphs_equals_plain(tmp_path, spec):
    path = build_tiny_llama(tmp_path / "sharp", seed=3, initializer_range=0.25)  # logits far from ties
    if spec == "draft":
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    prompts = PROMPTS  # the CPU test's: their greedy continuations repeat, so n-gram drafts get accepted
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(path, device="cuda", max_model_len=128)
    spec_llm = make_llm(path, device="cuda", max_model_len=128, speculative_config=spec)
    assert spec_llm.engine.runner.graphs is not None
    assert generate_ids(spec_llm, prompts, params) == generate_ids(plain, prompts, params)
    assert spec_llm.get_metrics()["sparrow:spec_decode_num_accepted_tokens"] > 0
    torch.cuda.synchronize()
