"""The engine configs validate themselves and hold the engine's defaults once; ``LLM.from_model`` wraps a built
model. Oracles: the messages LLM gave before (tests/test_bad_input.py checks them through LLM), the dataclass
fields (LLM's and the CLI's defaults must be theirs), and ``LLM(path)`` on the same checkpoint (same greedy ids)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.config import DEFAULT_MAX_MODEL_LEN_CAP, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sparrow.errors import InvalidRequestError
from tests.helpers import TINY_CONFIG, ids_prompt, make_llm, random_prompts, tiny_model_dir  # noqa: F401


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir) -> ModelConfig:
    from sparrow.loader.model_loader import read_model_config

    return read_model_config(tiny_model_dir)[0]


@pytest.mark.parametrize("make, needle", [
    (lambda: CacheConfig(block_size=24), "block_size=24"),
    (lambda: CacheConfig(block_size=0), "block_size=0"),
    (lambda: CacheConfig(num_blocks=0), "num_kv_blocks=0"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"),
    (lambda: CacheConfig(cpu_kv_cache_bytes=0), "cpu_kv_cache_bytes=0"),
    (lambda: CacheConfig(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is not supported"),
    (lambda: CacheConfig(calculate_kv_scales="yes"), "calculate_kv_scales='yes'"),
    (lambda: CacheConfig(kv_cache_dtype_skip_layers=["full"]), "kv_cache_dtype_skip_layers entry 'full'"),
    (lambda: CacheConfig(kv_cache_dtype_skip_layers=[-1]), "kv_cache_dtype_skip_layers entry -1"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0"),
    (lambda: SchedulerConfig(max_num_batched_tokens=2.5), "max_num_batched_tokens=2.5"),
    (lambda: SchedulerConfig(max_num_seqs=True), "max_num_seqs=True"),
])
def test_cache_and_scheduler_configs_refuse_bad_values(make, needle):
    with pytest.raises(InvalidRequestError, match="^" + needle.replace(".", r"\.")):
        make()


@pytest.mark.parametrize("kw, needle", [
    (dict(device="tpu"), "'tpu'"),
    (dict(dtype="float8"), "'float8'"),
    (dict(device="cpu", dtype="float16"), "float16"),
    (dict(max_model_len=513), "max_model_len=513 exceeds the model's 512 positions"),
    (dict(max_model_len=1), "max_model_len=1"),
    (dict(max_model_len="abc"), "max_model_len='abc'"),
    (dict(max_model_len=64, cache=CacheConfig(block_size=16, num_blocks=3)), "num_kv_blocks=3 of 16 tokens"),
])
def test_engine_config_refuses_bad_values(tiny_config, kw, needle):
    with pytest.raises(InvalidRequestError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=tiny_config, **kw)


def test_engine_config_resolves_auto_once(tiny_config):
    cfg = EngineConfig(model=tiny_config)
    assert cfg.device in ("cpu", "cuda") and cfg.dtype in ("float32", "bfloat16")
    assert cfg.max_model_len == min(TINY_CONFIG["max_position_embeddings"], DEFAULT_MAX_MODEL_LEN_CAP) == 512
    again = cfg.replace(max_model_len=64)  # validated again, resolved values kept
    assert (again.device, again.dtype, again.max_model_len) == (cfg.device, cfg.dtype, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_model_len = 3


def test_llm_and_cli_defaults_are_the_config_fields():
    """Defaults written once: LLM's keyword defaults and the CLI's are the dataclass fields' defaults."""
    from sparrow.cli import build_parser

    fields = {f.name: f.default for c in (CacheConfig, SchedulerConfig, EngineConfig) for f in dataclasses.fields(c)
              if f.default is not dataclasses.MISSING}
    fields["num_kv_blocks"] = fields.pop("num_blocks")
    sig = inspect.signature(LLM.__init__).parameters
    shared = [n for n in fields if n in sig]
    assert set(shared) == {"device", "dtype", "max_model_len", "block_size", "num_kv_blocks", "enable_prefix_caching",
                           "max_num_seqs", "max_num_batched_tokens", "enforce_eager",
                           "gpu_memory_utilization", "kv_cache_memory", "kv_cache_dtype", "calculate_kv_scales",
                           "kv_cache_dtype_skip_layers"}
    for name in shared:
        assert sig[name].default == fields[name], name
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.device, args.dtype, args.max_model_len) == (fields["device"], fields["dtype"], fields["max_model_len"])
    assert (args.kv_cache_dtype, args.calculate_kv_scales) == (fields["kv_cache_dtype"], fields["calculate_kv_scales"])


def test_skip_layers_are_normalized():
    """kv_cache_dtype_skip_layers: a list or a comma-separated string (the CLI's) of 'sliding_window' and indices."""
    assert CacheConfig(kv_cache_dtype_skip_layers="sliding_window, 3,0").kv_cache_dtype_skip_layers == (
        "sliding_window", 3, 0)
    assert CacheConfig(kv_cache_dtype_skip_layers=[1, "2", 1]).kv_cache_dtype_skip_layers == (1, 2)
    assert CacheConfig().kv_cache_dtype_skip_layers == ()


def test_from_model_generates_what_llm_of_the_path_generates(tiny_model_dir):
    from sparrow.loader.model_loader import load_model

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [ids_prompt(p) for p in random_prompts([7, 12], seed=5)]
    ref = make_llm(tiny_model_dir, max_model_len=64).generate(prompts, params)
    built = load_model(tiny_model_dir, torch.float32, "cpu").model
    llm = LLM.from_model(built, max_model_len=64, block_size=8)
    assert (llm.config.device, llm.config.dtype, llm.config.cache.block_size) == ("cpu", "float32", 8)
    assert llm.tokenizer is None and llm.model_path is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in ref]


def test_from_model_refuses_what_does_not_fit(tiny_model_dir):
    from sparrow.loader.model_loader import load_model

    built = load_model(tiny_model_dir, torch.float32, "cpu").model
    with pytest.raises(InvalidRequestError, match="sparrow model"):
        LLM.from_model(torch.nn.Linear(2, 2))
    with pytest.raises(InvalidRequestError, match="dtype='bfloat16'.*float32"):
        LLM.from_model(built, dtype="bfloat16")
    with pytest.raises(InvalidRequestError, match="max_num_seqs=0"):
        LLM.from_model(built, max_num_seqs=0)
    with pytest.raises(InvalidRequestError, match="LLM.from_model"):
        LLM(built)
