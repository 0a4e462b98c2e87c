"""Building what is measured: sparrow's engine and transformers' model, from a named shape (random weights,
shared) or from a checkpoint."""
from __future__ import annotations

import gc
from pathlib import Path

import torch

from sparrow.errors import InvalidRequestError, UnsupportedArchitectureError
from sparrow.config import TORCH_DTYPES as _DTYPES
from sparrow.devices import peak_memory, reset_peak_memory

from sparrow.bench.footprint import footprint
from sparrow.bench.settings import Settings
from sparrow.bench.timing import HFRunner, SparrowRunner


def engine_kwargs(s: Settings, max_model_len: int | None) -> dict:
    """LLM's engine arguments for the benchmark (``LLM(path, ...)`` and ``LLM.from_model``): a KV pool that
    holds every sequence of the largest batch at once, no prefix caching (each run uses fresh prompts anyway),
    a step budget that prefills one prompt whole (at least 8192 tokens on a GPU)."""
    from sparrow.config import CacheConfig, SchedulerConfig

    mml = max_model_len or s.max_model_len
    if mml < s.max_model_len:
        raise InvalidRequestError(f"--max-model-len {mml} is shorter than prompt + decode tokens ({s.max_model_len})")
    block, top = CacheConfig.block_size, max(s.batch_sizes)
    budget = 8192 if s.device.startswith("cuda") else SchedulerConfig.max_num_batched_tokens
    return dict(max_model_len=mml, num_kv_blocks=top * -(-mml // block) + top, max_num_seqs=max(top, 1),
                max_num_batched_tokens=max(budget, max(s.prompt_lens)), enable_prefix_caching=False,
                enforce_eager=s.enforce_eager, gpu_memory_utilization=s.gpu_memory_utilization,
                kv_cache_dtype=s.kv_cache_dtype, tensor_parallel_size=s.tensor_parallel_size,
                enable_expert_parallel=s.enable_expert_parallel)


def sparrow_model_random(cfg: dict, full_cfg: dict, s: Settings):
    """sparrow's model for the shape dict ``cfg`` on the device (``model_shapes.random_model``): the random weights
    of ``s.seed`` (those of ``build_random_hf_model``) streamed in one module at a time and quantized as ``s``
    asks (``--quantization``, ``--quantize-lm-head``) as they come, or random GGUF blocks of llama.cpp's type mix
    for ``--quantization gguf-q4_k_m`` / ``gguf-q8_0`` (``full_cfg``, the config.json form, is derived from ``cfg``
    again there). Raises UnsupportedArchitectureError if sparrow lacks the architecture."""
    from sparrow.model_shapes import random_model

    return random_model(cfg, _DTYPES[s.dtype], s.device, s.quantization, s.quantize_lm_head, s.seed)


def sparrow_from_shape(cfg: dict, full_cfg: dict, s: Settings, engine_kw: dict, meta: dict | None = None):
    """``sparrow_model_random`` wrapped in an Engine by ``LLM.from_model`` (no tokenizer); ``meta`` (if given)
    gets ``load_peak_memory_bytes``, the peak while the weights streamed in (before the KV pool and graphs).
    Raises UnsupportedArchitectureError if sparrow lacks the architecture."""
    import functools

    from sparrow.config import ModelConfig
    from sparrow.llm import LLM

    # a --max-model-len beyond the shape's positions only sizes the KV pool (num_kv_blocks); prompt + decode
    # tokens were checked against the positions
    mcfg = ModelConfig.from_hf(full_cfg)
    kw = dict(engine_kw, max_model_len=min(engine_kw["max_model_len"], mcfg.max_position_embeddings))
    reset_peak_memory(s.device)
    if s.tensor_parallel_size > 1:  # every rank builds the shape with the same seed
        llm = LLM.from_builder(functools.partial(_shape_model_on, cfg, full_cfg, s), mcfg, device=s.device,
                               dtype=s.dtype, **kw)
        if meta is not None:
            meta["load_peak_memory_bytes"] = peak_memory(s.device)  # rank 0's peak, KV pool and graphs included
        return llm.engine
    model = sparrow_model_random(cfg, full_cfg, s)
    if meta is not None:
        meta["load_peak_memory_bytes"] = peak_memory(s.device)
    return LLM.from_model(model, device=s.device, dtype=s.dtype, **kw).engine


def _shape_model_on(cfg: dict, full_cfg: dict, s: Settings, device: str):
    """``sparrow_model_random`` on ``device`` (a tensor-parallel rank's build)."""
    import dataclasses

    return sparrow_model_random(cfg, full_cfg, dataclasses.replace(s, device=device))


def load_hf_pretrained(path: Path, s: Settings):
    """transformers' model from a .gguf file (dequantized to the dtype) or an HF folder, on the device."""
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[s.hf_dtype or s.dtype]
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(s.device).eval()


def kv_capacity_tokens(engine, s: Settings) -> int | None:
    """Tokens a KV pool in the engine's cache dtype would hold at ``s.gpu_memory_utilization`` beside what the
    engine holds now besides its own pool (weights, CUDA graphs): what ``sparrow serve`` would get (the bench
    sizes its pool to its largest batch instead). None off CUDA."""
    if not s.device.startswith("cuda"):
        return None
    runner = engine.runner
    total = torch.cuda.get_device_properties(torch.device(s.device)).total_memory
    held = torch.cuda.memory_allocated(s.device) - runner.kv_pool.nbytes
    return max(0, int((s.gpu_memory_utilization * total - held) // runner.kv_cache.bytes_per_token))


def _print_load_peak(meta: dict, device: str) -> None:
    kind = "torch's GPU allocator" if device.startswith("cuda") else "process RSS"
    print(f"sparrow's load peaked at {meta['load_peak_memory_bytes'] / 2**20:.0f} MiB ({kind})", flush=True)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def shape_runners(name: str, s: Settings, engine_kw: dict, with_hf: bool, meta: dict):
    """Yield (runner, footprint, vocab) for sparrow, then transformers, on one random-weight model of a
    named shape, the same weights in both (``model_shapes.random_weights`` for ``s.seed``). sparrow's model is
    filled from the stream one module at a time (the float model never exists whole: gemma4-26b-a4b in FP8 on
    an 80 GB GPU) and freed before transformers' is built."""
    from sparrow.model_shapes import build_random_hf_model, full_config_dict, hf_skeleton, shape_config

    cfg = shape_config(name)
    full = full_config_dict(cfg)
    tied, hidden, vocab = bool(full.get("tie_word_embeddings")), int(full["hidden_size"]), int(full["vocab_size"])
    limit = full.get("max_position_embeddings")
    if limit and s.max_model_len > limit:
        raise InvalidRequestError(f"prompt + decode tokens ({s.max_model_len}) exceed the {name} "
                                  f"shape's {limit} positions")
    quant = f", {s.quantization} for sparrow" if s.quantization else ""
    quant += " (LM head too)" if s.quantize_lm_head else ""
    print(f"building random-weight {name} ({s.dtype}{quant}) on {s.device} ...", flush=True)
    skeleton = hf_skeleton(cfg, _DTYPES[s.dtype])  # parameters on meta: names and sizes only
    meta["params"] = sum(p.numel() for p in skeleton.parameters())
    fp = hf_fp = footprint(skeleton, full, tied, hidden)  # each engine's row uses the bytes of its own weights
    del skeleton
    try:
        engine = sparrow_from_shape(cfg, full, s, engine_kw, meta)
        _print_load_peak(meta, s.device)
    except UnsupportedArchitectureError as e:
        print(f"sparrow cannot run {name} yet ({e}); measuring transformers only", flush=True)
        meta["sparrow_error"] = str(e)
        engine = None
    if engine is not None:
        fp = footprint(engine.runner.model, full, tied, hidden)
        meta["kv_capacity_tokens"] = kv_capacity_tokens(engine, s)
        yield SparrowRunner(engine), fp, vocab
        del engine
        _free(s.device)
    if with_hf:
        yield HFRunner(build_random_hf_model(cfg, _DTYPES[s.dtype], s.device, seed=s.seed), s.device), hf_fp, vocab


def path_runners(path: Path, s: Settings, engine_kw: dict, with_hf: bool, meta: dict):
    """Yield (runner, footprint, vocab) for sparrow's LLM on a checkpoint, then (after freeing it) for
    transformers' model loaded from the same file; each footprint counts that engine's own weight bytes. When
    transformers cannot load the checkpoint (a GPTQ one without optimum, ...), its runner is skipped with a line
    naming the error, also kept as ``meta["hf_error"]``."""
    from sparrow.llm import LLM

    print(f"loading {path} with sparrow ({s.dtype}, {s.device}) ...", flush=True)
    quant = {"quantization": s.quantization} if s.quantization else {}
    if s.quantize_lm_head:
        quant["quantize_lm_head"] = True
    llm = LLM(str(path), device=s.device, dtype=s.dtype, skip_tokenizer_init=True, **quant, **engine_kw)
    engine, meta["load_peak_memory_bytes"] = llm.engine, llm.load_peak_memory
    del llm
    _print_load_peak(meta, s.device)
    meta["kv_capacity_tokens"] = kv_capacity_tokens(engine, s)
    mcfg = engine.config.model
    fp = footprint(engine.runner.model, mcfg.raw, mcfg.tie_word_embeddings, mcfg.hidden_size)
    meta["params"] = sum(p.numel() for p in engine.runner.model.parameters())
    yield SparrowRunner(engine), fp, mcfg.vocab_size
    del engine
    _free(s.device)
    if with_hf:
        print(f"loading {path} with transformers ...", flush=True)
        try:
            hf = load_hf_pretrained(path, s)  # its own bytes: transformers dequantizes GGUF / FP8 weights
        except Exception as e:  # whatever transformers raises for a checkpoint it cannot run
            meta["hf_error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            print(f"transformers cannot load {path} ({meta['hf_error']}): no transformers rows", flush=True)
            return
        yield HFRunner(hf, s.device), footprint(hf, mcfg.raw, mcfg.tie_word_embeddings, mcfg.hidden_size), \
            mcfg.vocab_size


# ---------------------------------------------------------------------------------------------- report
