"""The n-gram proposer's lookup against a brute-force search, the speculative config's validation, and the
draft limit (drafts never pass max_tokens or max_model_len)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from sparrow.config import SpeculativeConfig
from sparrow.engine.sequence import Sequence
from sparrow.errors import InvalidRequestError
from sparrow.sampling_params import SamplingParams
from sparrow.spec_decode.decoder import draft_limit
from sparrow.spec_decode.ngram import NgramProposer, lookup
from tests.helpers import raises, tiny_model_dir, tiny_text_model_dir  # noqa: F401  (fixtures)


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The definition, by plain loops: for n from n_max down, the latest i < L - n with tokens[i:i+n] equal to
    the last n tokens; the k tokens after it."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[L - n:]:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_lookup_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 50])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    n_min = rng.randint(1, 3)
    n_max = rng.randint(n_min, 5)
    k = rng.randint(1, 7)
    assert lookup(np.array(tokens, dtype=np.int64), n_min, n_max, k) == brute_force(tokens, n_min, n_max, k)


def test_proposer_follows_a_growing_sequence():
    seq = Sequence("r", 0, [1, 2, 3, 4, 1, 2], SamplingParams(), set())
    prop = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    assert prop.propose([(seq, 3)]) == [[3, 4, 1]]
    seq.output_token_ids += [3, 9] + list(range(20, 200))  # grows past the buffer's first capacity
    seq.output_token_ids += [20, 21]
    assert prop.propose([(seq, 2)]) == [[22, 23]]
    assert prop.propose([(seq, 2)]) == [brute_force(seq.tokens(0, seq.num_tokens), 2, 3, 2)]


def test_draft_limit_stops_at_max_tokens_and_max_model_len():
    seq = Sequence("r", 0, [1] * 10, SamplingParams(max_tokens=8), set())
    seq.output_token_ids = [5] * 5
    # 5 generated, max_tokens 8: a verify step of d drafts appends up to d + 1 tokens -> d <= 2
    assert draft_limit(seq, 4, max_model_len=100) == 2
    assert draft_limit(seq, 4, max_model_len=17) == 1  # 15 tokens now; 17 - 15 - 1
    seq.output_token_ids = [5] * 7
    assert draft_limit(seq, 4, max_model_len=100) == 0


@pytest.mark.parametrize("spec, needles", [
    ({"method": "eagle", "num_speculative_tokens": 2}, ("method='eagle'", "ngram")),
    ({"method": "ngram"}, ("num_speculative_tokens",)),
    ({"method": "ngram", "num_speculative_tokens": 0}, ("num_speculative_tokens=0",)),
    ({"method": "ngram", "num_speculative_tokens": 99}, ("num_speculative_tokens=99", "15")),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     ("prompt_lookup_min=5", "prompt_lookup_max=3")),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, ("'lookahead'",)),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ("'model'",)),
    ({"num_speculative_tokens": 2}, ("'method'",)),
    ("ngram", ("must be a dict",)),
])
def test_bad_speculative_config_names_the_problem(spec, needles):
    raises(InvalidRequestError, lambda: SpeculativeConfig.from_dict(spec), *needles)


def test_model_alone_means_draft_model():
    spec = SpeculativeConfig.from_dict({"model": "/some/path", "num_speculative_tokens": 3})
    assert spec.method == "draft_model" and spec.model == "/some/path"


def test_cli_speculative_config(tiny_text_model_dir):  # noqa: F811
    """--speculative-config: bad JSON and a bad key exit 2 with one line naming the problem; with a valid one
    `generate` prints what plain decoding (LLM.generate) gives."""
    from tests.helpers import assert_cli_error, run_cli

    base = ["generate", "abcabcabc", "--model", str(tiny_text_model_dir), "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "12", "--temperature", "0"]
    assert_cli_error(run_cli(*base, "--speculative-config", "{method: ngram"), "--speculative-config",
                     "not valid JSON")
    assert_cli_error(run_cli(*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                                                            '"lookahead": 3}'), "'lookahead'")
    from sparrow import LLM, SamplingParams

    spec = run_cli(*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                  '"prompt_lookup_min": 1}')
    assert spec.returncode == 0, spec.stderr
    plain = LLM(str(tiny_text_model_dir), device="cpu", dtype="float32").generate(
        "abcabcabc", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert spec.stdout.rstrip("\n") == plain and plain
