"""Tensor parallelism, engine side, on two CPU ranks (gloo): ``LLM(..., tensor_parallel_size=2)`` gives TP=1's fp32
greedy ids, logprobs (within LOGPROB_ATOL) and prompt logprobs, with prefills chunked over several steps beside
decode rows, LoRA adapters swapped through one slot, a MoE with expert parallelism on and the packaged default
model; a worker failing to load or in a step raises WorkerError naming its rank within a timeout; close() and
garbage collection leave no child process. Until the model side shards the layers every rank holds the whole
model, so these tests check the step broadcast, the workers' lock step and their lifecycle."""
from __future__ import annotations

import functools
import gc
import multiprocessing
import time

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.errors import WorkerError
from sparrow.loader.model_loader import read_model_config
from sparrow.lora.request import LoRARequest
from tests.engine import _tp_builders
from tests.helpers import LOGPROB_ATOL, ids_prompt, make_llm, random_prompts
from tests.lora._adapters import base_model, make_adapter

LENGTHS = (5, 40, 3, 23)
"""With a step budget of 16 tokens the 40- and 23-token prompts prefill over several steps beside decode rows."""
FAIL_WITHIN_S = 30.0


def _same(a, b) -> None:
    """Equal ids, logprobs within LOGPROB_ATOL, equal prompt-logprob ranks and values within it."""
    for x, y in zip(a, b, strict=True):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        for dx, dy in zip(cx.logprobs or [], cy.logprobs or [], strict=True):
            assert dx.keys() == dy.keys()
            assert all(abs(dx[t].logprob - dy[t].logprob) <= LOGPROB_ATOL for t in dx)
        for dx, dy in zip(x.prompt_logprobs or [], y.prompt_logprobs or [], strict=True):
            if dx is not None:
                assert {t: v.rank for t, v in dx.items()} == {t: v.rank for t, v in dy.items()}
                assert all(abs(dx[t].logprob - dy[t].logprob) <= LOGPROB_ATOL for t in dx)


@pytest.fixture(autouse=True, scope="module")
def _one_thread_per_rank():
    """One torch thread per rank (the workers take rank 0's count): two ranks of two threads each on a small
    machine stall each other's steps."""
    from sparrow.devices import cpu_threads

    with cpu_threads(1):
        yield


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)  # rank 0 samples
LORA = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama and two LoRA adapters of it."""
    root = tmp_path_factory.mktemp("tp")
    path = base_model("llama", root / "base")
    for i in (1, 2):
        make_adapter("llama", path, root / f"lora{i}", seed=i, r=4, target_modules=["q_proj", "down_proj"])
    return path


def _loras(base):
    reqs = [LoRARequest(f"a{i}", i, str(base.parent / f"lora{i}")) for i in (1, 2)]
    return [[reqs[0]] * 4, [reqs[1]] * 4, [None, reqs[0], None, reqs[0]]]  # one slot: rewritten each time


def _run(llm, params, loras=None):
    return llm.generate([ids_prompt(p) for p in random_prompts(LENGTHS)], params, lora_request=loras)


def _soft(llm):
    """A prompt with two soft-token rows (caller-supplied embeddings, pickled with the step's rows)."""
    g = torch.Generator().manual_seed(5)
    prompt = {"prompt_token_ids": random_prompts([9])[0], "soft_embeds": torch.randn(2, 64, generator=g),
              "soft_positions": [2, 3]}
    return llm.generate([prompt], LORA)


def _runs(llm, base):
    return [_run(llm, GREEDY), _run(llm, SEEDED), _soft(llm)] + [_run(llm, LORA, lr) for lr in _loras(base)]


class TestDense:
    @pytest.fixture(scope="class")
    def runs(self, base):
        """(TP=1's outputs, TP=2's) of the same calls on the tiny Llama with LoRA on (one slot). TP=1 runs and goes
        first: a one-rank LLM cannot be made while a tensor-parallel one runs in the process."""
        kw = dict(max_model_len=128, max_num_batched_tokens=16, enable_lora=True, max_loras=1, max_lora_rank=4)
        one = make_llm(base, **kw)
        expected = _runs(one, base)
        del one
        two = make_llm(base, tensor_parallel_size=2, **kw)
        try:
            return expected, _runs(two, base)
        finally:
            two.close()

    def test_greedy_logprobs_prompt_logprobs_seeded_sampling_and_soft_tokens_equal_tp1(self, runs):
        for expected, got in zip(runs[0][:3], runs[1][:3]):  # and soft-token rows
            _same(expected, got)

    def test_lora_slot_swaps_equal_tp1(self, runs):
        for expected, got in zip(runs[0][3:], runs[1][3:]):
            _same(expected, got)


def test_tp2_expert_parallel_moe_equals_tp1(tmp_path):
    base = base_model("qwen3_moe", tmp_path / "moe")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    kw = dict(max_model_len=96, max_num_batched_tokens=16)
    expected = _run(make_llm(base, **kw), params)
    two = make_llm(base, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        _same(expected, _run(two, params))
    finally:
        two.close()


def test_tp2_packaged_default_model_equals_tp1():
    from sparrow.default_model import default_model_path

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    prompts = ["The capital of France is", "1, 2, 3,"]
    kw = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)
    expected = LLM(default_model_path(), **kw).generate(prompts, params)
    two = LLM(default_model_path(), tensor_parallel_size=2, **kw)
    try:
        got = two.generate(prompts, params)
    finally:
        two.close()
    _same(expected, got)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]


def _from_builder(build, path):
    return LLM.from_builder(functools.partial(build, str(path)), read_model_config(path)[0], device="cpu",
                            dtype="float32", max_model_len=64, tensor_parallel_size=2)


def _tp_workers() -> list:
    """This process's live tensor-parallel worker processes (``sparrow-tp-rankN``; a server test's frontend may
    share the pytest worker)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("sparrow-tp-")]


def test_worker_failing_to_load_raises_naming_rank(base):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 failed: RuntimeError: injected load failure on rank 1"):
        _from_builder(_tp_builders.fail_to_load_on_workers, base)
    assert time.monotonic() - start < FAIL_WITHIN_S
    assert not _tp_workers()


def test_worker_failing_in_a_step_raises_naming_rank(base):
    llm = _from_builder(functools.partial(_tp_builders.fail_in_step_on_workers, steps=3), base)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 failed: RuntimeError: injected step failure on rank 1"):
        llm.generate([ids_prompt([1, 2, 3])], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert time.monotonic() - start < FAIL_WITHIN_S
    with pytest.raises(WorkerError, match="rank 1"):  # the group stays broken
        llm.generate([ids_prompt([1, 2, 3])], SamplingParams(max_tokens=2))
    llm.close()
    assert not _tp_workers()


def test_random_shape_on_two_ranks_equals_one_and_gc_stops_the_workers():
    """``random_llm`` (serve --model-shape) builds the shape on every rank with the same seed; dropping the LLM
    stops its worker with the shutdown message (exit code 0, not a kill)."""
    from sparrow.model_shapes import random_llm

    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_model_len=64, seed=3)
    expected = _run(random_llm("tiny-moe", **kw), params)
    two = random_llm("tiny-moe", tensor_parallel_size=2, **kw)
    (proc,) = two._workers.procs
    try:
        _same(expected, _run(two, params))
    finally:
        del two
        gc.collect()
    assert not proc.is_alive() and proc.exitcode == 0
    assert not _tp_workers()


def test_bench_tensor_parallel_flag(tmp_path):
    """``sparrow bench --model-shape X --tensor-parallel-size 2`` runs, and its workers end with its engine."""
    import json

    from sparrow.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--model-shape", "tiny-dense", "--device", "cpu", "--batch-sizes", "1", "--prompt-len",
                 "5", "--decode-tokens", "3", "--no-hf", "--tensor-parallel-size", "2", "--out", str(out)]) == 0
    assert any(r["engine"] == "sparrow" for r in json.loads(out.read_text())["results"])
    gc.collect()
    assert not _tp_workers()


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_cli_parallel_flags(command):
    from sparrow.cli import build_parser
    from sparrow.cli_support import parallel_args

    args = build_parser().parse_args([command, "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert parallel_args(args) == dict(tensor_parallel_size=2, enable_expert_parallel=True)
    assert parallel_args(build_parser().parse_args([command])) == dict(tensor_parallel_size=1,
                                                                       enable_expert_parallel=False)


def test_ngram_speculation_on_two_ranks_equals_one_and_draft_models_are_refused(base):
    """n-gram verify steps (k + 1 rows per sequence) run on every rank; a draft model is refused before any spawn."""
    from sparrow.errors import InvalidRequestError

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [ids_prompt([1, 2, 3, 4] * 3), ids_prompt(random_prompts([7])[0])]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    kw = dict(max_model_len=64, speculative_config=spec)
    expected = make_llm(base, **kw).generate(prompts, params)
    two = make_llm(base, tensor_parallel_size=2, **kw)
    try:
        _same(expected, two.generate(prompts, params))
    finally:
        two.close()
    draft = {"method": "draft_model", "model": str(base), "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequestError, match="draft_model.*tensor_parallel_size=2"):
        make_llm(base, max_model_len=64, speculative_config=draft, tensor_parallel_size=2)
    assert not _tp_workers()
