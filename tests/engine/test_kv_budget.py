"""KV pool sizing (``sparrow.engine.kv_budget``): plan_kv_pool as a pure function of byte counts, size strings,
the pool an LLM gets on CPU with kv_cache_memory (and its start-up line), and the --kv-cache-memory flag."""
from __future__ import annotations

import logging

import pytest

from sparrow.config import CacheConfig
from sparrow.engine.kv_budget import GIB, GRAPH_FIXED_BYTES, graph_reserve_bytes, parse_size, plan_kv_pool
from sparrow.errors import InsufficientMemoryError, InvalidRequestError
from tests.helpers import make_llm, tiny_model_dir  # noqa: F401  (fixture)

MIB = 1 << 20
PER_TOKEN, BLOCK = 1000, 16
PER_BLOCK = PER_TOKEN * BLOCK
# an 80 GiB card with 60 GiB of weights loaded (+ 1 GiB of context): 19 GiB free
GPU = dict(device_total=80 * GIB, device_free=19 * GIB, weights_bytes=60 * GIB)


def plan(**kw):
    args = dict(bytes_per_token=PER_TOKEN, block_size=BLOCK, max_model_len=4096, max_num_seqs=1000)
    return plan_kv_pool(**{**args, **kw})


def test_gpu_pool_is_utilization_budget_less_use_and_graphs():
    pool = plan(**GPU, gpu_memory_utilization=0.9, graph_reserve=GIB, max_num_seqs=10**6)
    budget = 0.9 * 80 * GIB - (80 - 19) * GIB - GIB
    assert pool.num_blocks == int(budget // PER_BLOCK) - 1  # the pad block comes out of the budget
    assert pool.num_tokens == pool.num_blocks * BLOCK and pool.nbytes == (pool.num_blocks + 1) * PER_BLOCK
    assert "gpu_memory_utilization=0.9" in pool.budget


def test_pool_capped_at_max_num_seqs_sequences():
    pool = plan(cpu_budget=GIB, max_num_seqs=2)
    assert pool.num_blocks == 2 * 4096 // BLOCK and "max_num_seqs=2" in pool.budget


def test_model_that_does_not_fit_names_weights_free_total_and_flag():
    with pytest.raises(InsufficientMemoryError) as e:
        plan(**GPU, gpu_memory_utilization=0.75)  # 60 GiB budget < 61 GiB in use
    msg = str(e.value)
    for needle in ("max_model_len=4096", "weights take 60.00 GiB", "19.00 GiB free", "80.00 GiB total",
                   "--gpu-memory-utilization", "--kv-cache-memory", "--max-model-len"):
        assert needle in msg, needle


def test_kv_cache_memory_overrides_utilization():
    pool = plan(**GPU, gpu_memory_utilization=0.1, kv_cache_memory=2 * GIB)
    assert pool.num_blocks == 2 * GIB // PER_BLOCK - 1 and "kv_cache_memory=2.00 GiB" in pool.budget
    cpu = plan(cpu_budget=GIB, kv_cache_memory=8 * MIB, max_num_seqs=1)  # not capped at max_num_seqs
    assert cpu.num_blocks == 8 * MIB // PER_BLOCK - 1


def test_kv_cache_memory_beyond_free_memory_fails():
    with pytest.raises(InsufficientMemoryError,
                       match=r"kv_cache_memory=20.00 GiB .*19.00 GiB free.*--kv-cache-memory"):
        plan(**GPU, kv_cache_memory=20 * GIB)


def test_num_kv_blocks_is_authoritative():
    assert plan(**GPU, num_kv_blocks=300, gpu_memory_utilization=0.1).num_blocks == 300
    assert plan(cpu_budget=1, num_kv_blocks=300).num_blocks == 300
    with pytest.raises(InsufficientMemoryError, match=r"num_kv_blocks=10000000 .*--num-kv-blocks"):
        plan(**GPU, num_kv_blocks=10_000_000)
    with pytest.raises(InsufficientMemoryError, match="num_kv_blocks=3 of 16 tokens"):
        plan(cpu_budget=GIB, num_kv_blocks=3)


def test_num_kv_blocks_with_kv_cache_memory_refused():
    with pytest.raises(InvalidRequestError, match="num_kv_blocks=300 and kv_cache_memory"):
        plan(cpu_budget=GIB, num_kv_blocks=300, kv_cache_memory=GIB)
    with pytest.raises(InvalidRequestError, match="num_kv_blocks=8 and kv_cache_memory=1048576"):
        CacheConfig(num_blocks=8, kv_cache_memory="1MiB")


@pytest.mark.parametrize("kw", [dict(cpu_budget=4 * MIB), dict(cpu_budget=GIB, kv_cache_memory=4 * MIB),
                                dict(**GPU, kv_cache_memory=4 * MIB)])
def test_max_model_len_beyond_the_pool_fails(kw):
    """4 MiB holds 261 blocks (+ the pad block) = 4176 tokens of 1000 bytes, less than max_model_len 8192: an error, no silent bump."""
    with pytest.raises(InsufficientMemoryError, match=r"max_model_len=8192 .* holds 4176 tokens.*--max-model-len"):
        plan(max_model_len=8192, **kw)


def test_graph_reserve_is_fp32_logits_per_graph_plus_a_constant():
    assert graph_reserve_bytes([1, 2, 4], (1, 2), 100) == (7 + 14) * 100 * 4 + 6 * GRAPH_FIXED_BYTES
    assert graph_reserve_bytes([], (1,), 100) == 0


@pytest.mark.parametrize("text, want", [(4096, 4096), ("4096", 4096), ("8GiB", 8 * GIB), ("8G", 8 * GIB),
                                        ("8gi", 8 * GIB), ("512MiB", 512 * MIB), ("512m", 512 * MIB),
                                        ("1.5GiB", 3 * GIB // 2), ("8 GiB", 8 * GIB), ("2KiB", 2048),
                                        ("8GB", 8 * 10**9), ("1TiB", 1 << 40)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "GiB", "8XB", "eight", "8GiB!", "-1", "1e9", 0, -5, 1.5, True, None])
def test_parse_size_refuses_naming_the_value(bad):
    with pytest.raises(InvalidRequestError) as e:
        parse_size(bad)
    assert f"kv_cache_memory={bad!r}" in str(e.value)


def test_llm_on_cpu_gets_the_pool_kv_cache_memory_holds(tiny_model_dir, caplog):
    from sparrow import SamplingParams
    from sparrow.engine.model_runner import kv_bytes_per_token

    with caplog.at_level(logging.INFO, logger="sparrow.engine.model_runner"):
        llm = make_llm(tiny_model_dir, max_model_len=64, kv_cache_memory="1MiB")
    runner = llm.engine.runner
    per_block = kv_bytes_per_token(runner.model, runner.dtype) * 16
    pool = runner.kv_pool
    assert pool.num_blocks == MIB // per_block - 1 == runner.num_blocks == llm.engine.block_manager.num_blocks
    assert llm.config.cache.kv_cache_memory == MIB
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert lines == [f"KV pool: {pool.num_blocks} blocks x 16 tokens = {pool.num_blocks * 16} tokens, 1.00 MiB "
                     "(budget: kv_cache_memory=1.00 MiB); KV cache dtype auto"]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_llm_max_model_len_beyond_kv_cache_memory_fails_at_start(tiny_model_dir):
    with pytest.raises(InsufficientMemoryError, match="max_model_len=512"):
        make_llm(tiny_model_dir, max_model_len=512, kv_cache_memory="64KiB")


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_cli_kv_cache_memory(command):
    from sparrow.cli import build_parser

    parse = build_parser().parse_args
    assert parse(command).kv_cache_memory is None
    assert parse([*command, "--kv-cache-memory", "8GiB"]).kv_cache_memory == 8 * GIB
    assert parse([*command, "--kv-cache-memory-bytes", "1000"]).kv_cache_memory == 1000  # vLLM's spelling


@pytest.mark.parametrize("value", ["8XB", "0", "lots"])
def test_cli_kv_cache_memory_refused(value, capsys):
    from sparrow.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-cache-memory", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("sparrow: error:")
    assert "--kv-cache-memory" in err and repr(value) in err


def test_serve_passes_kv_cache_memory_and_refuses_it_with_num_kv_blocks():
    from sparrow.cli import build_parser
    from sparrow.server.main import _build_llm

    flags = ["serve", "--model-shape", "tiny-dense", "--device", "cpu", "--max-model-len", "32"]
    llm = _build_llm(build_parser().parse_args([*flags, "--kv-cache-memory", "1MiB"]))
    assert llm.config.cache.kv_cache_memory == MIB and llm.engine.runner.kv_pool.budget.startswith("kv_cache_memory")
    with pytest.raises(InvalidRequestError, match="num_kv_blocks=8 and kv_cache_memory"):
        _build_llm(build_parser().parse_args([*flags, "--kv-cache-memory", "1MiB", "--num-kv-blocks", "8"]))
