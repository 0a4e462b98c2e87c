"""``LLM``: the user-facing class (vLLM's names): load a model, generate for a batch of prompts. It is where the
parts meet: the loader builds the model (and a draft model), ``sparrow.spec_decode`` gives the speculator, and
``engine.engine.Engine`` runs them."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import weakref
from typing import Iterator, Sequence as Seq

import torch

from sparrow.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig, \
    SpeculativeConfig
from sparrow.devices import TORCH_DTYPES, ensure_cpu_threads, peak_memory, reset_peak_memory
from sparrow.engine.engine import Engine
from sparrow.errors import InvalidRequestError
from sparrow.outputs import RequestOutput
from sparrow.sampling_params import SamplingParams
from sparrow.spec_decode.decoder import make_speculative_decoder

log = logging.getLogger(__name__)

_E, _C, _S, _P = EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig  # the engine arguments' defaults are their fields'


def engine_config(model: ModelConfig, *, device: str = _E.device, dtype: str = _E.dtype,
                  max_model_len: int | None = _E.max_model_len, block_size: int = _C.block_size,
                  num_kv_blocks: int | None = _C.num_blocks, enable_prefix_caching: bool = _C.enable_prefix_caching,
                  max_num_seqs: int = _S.max_num_seqs, max_num_batched_tokens: int = _S.max_num_batched_tokens,
                  enforce_eager: bool = _E.enforce_eager,
                  gpu_memory_utilization: float = _C.gpu_memory_utilization,
                  kv_cache_memory: int | str | None = _C.kv_cache_memory,
                  speculative_config: dict | None = None, enable_lora: bool = False,
                  max_loras: int = LoRAConfig.max_loras, max_lora_rank: int = LoRAConfig.max_lora_rank,
                  max_cpu_loras: int | None = LoRAConfig.max_cpu_loras, kv_cache_dtype: str = _C.kv_cache_dtype,
                  calculate_kv_scales: bool = _C.calculate_kv_scales,
                  kv_cache_dtype_skip_layers=_C.kv_cache_dtype_skip_layers,
                  tensor_parallel_size: int = _P.tensor_parallel_size,
                  enable_expert_parallel: bool = _P.enable_expert_parallel) -> EngineConfig:
    """The EngineConfig for LLM's flat engine arguments (``num_kv_blocks`` is ``cache.num_blocks``;
    ``speculative_config``: vLLM's dict, ``SpeculativeConfig.from_dict``; ``tensor_parallel_size`` and
    ``enable_expert_parallel``: ``ParallelConfig``'s). The configs validate themselves:
    InvalidRequestError names the first bad argument (cache and scheduler settings, the speculative config,
    then device, dtype, max_model_len and the pool size)."""
    cache = CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                        gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=kv_cache_memory,
                        kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
                        kv_cache_dtype_skip_layers=kv_cache_dtype_skip_layers)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    if not isinstance(enable_lora, bool):
        raise InvalidRequestError(f"enable_lora={enable_lora!r} must be True or False")
    lora = (LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
            if enable_lora else None)
    if not isinstance(enable_expert_parallel, bool):
        raise InvalidRequestError(f"enable_expert_parallel={enable_expert_parallel!r} must be True or False")
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                              enable_expert_parallel=enable_expert_parallel)
    return EngineConfig(model=model, device=device, dtype=dtype, max_model_len=max_model_len, cache=cache,
                        scheduler=scheduler, enforce_eager=enforce_eager,
                        speculative=SpeculativeConfig.from_dict(speculative_config), lora=lora, parallel=parallel)


def _model_placement(model: torch.nn.Module) -> tuple[str, str]:
    """(device, dtype name) of a built model: those of its embedding table (``model.embed_tokens``) where it is a
    float table; else (a GGUF file's packed table, a model without one) its first parameter of a TORCH_DTYPES
    dtype. Raises InvalidRequestError when there is no such parameter."""
    names = {v: k for k, v in TORCH_DTYPES.items()}
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    params = [embed.weight] if isinstance(getattr(embed, "weight", None), torch.Tensor) else []
    params += [p for p in model.parameters() if p.dtype in names]
    params = [p for p in params if p.dtype in names]
    if not params:
        raise InvalidRequestError("the model has no float32 / bfloat16 / float16 parameter to take its dtype from")
    return str(params[0].device), names[params[0].dtype]


def load_model_module(path: str, dtype: torch.dtype, quantization: str | None, quantize_lm_head: bool,
                      device: str) -> torch.nn.Module:
    """The model ``load_model`` loads from ``path`` onto ``device`` (a tensor-parallel worker's build)."""
    from sparrow.loader.model_loader import load_model

    return load_model(path, dtype, device, quantization=quantization, quantize_lm_head=quantize_lm_head).model


def _start_workers(config: EngineConfig, build, seed: int):
    """The WorkerGroup of ranks 1..N-1 building ``build(device)`` (this process joins as rank 0), or None with one
    rank. Raises InvalidRequestError for a one-rank LLM while a tensor-parallel one runs in this process (its layers
    would read that group's rank and size)."""
    if config.parallel.world_size == 1:
        _check_no_group()
        return None
    from sparrow.engine.workers import WorkerGroup

    return WorkerGroup.start(config, build, seed)


def _check_no_group() -> None:
    from sparrow.distributed import tp_size

    if tp_size() > 1:
        raise InvalidRequestError(f"a tensor-parallel LLM of {tp_size()} ranks is running in this process: close() it "
                                  "before making a one-rank LLM (layers read the process's rank and size)")


@contextlib.contextmanager
def _starting(workers):
    """Around rank 0's build: a worker's failure raises WorkerError (``WorkerGroup.guard``), and the workers are
    stopped when the build raises."""
    if workers is None:
        yield
        return
    try:
        with workers.guard():
            yield
    except BaseException:
        workers.shutdown()
        raise


def _per_prompt_loras(lora_request, n: int) -> list:
    """One LoRARequest (or None) per prompt from ``generate``'s argument: None, one request for all, or a list of n."""
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise InvalidRequestError(f"got {len(lora_request)} lora_requests for {n} prompts (give one, or one per "
                                  "prompt)")
    return list(lora_request)


class LLM:
    """Load a model and generate.

    model: an HF folder (config.json + safetensors), a ``.gguf`` file, or None for the packaged default
    (Gemma 3 270M Q4_K_M); ``LLM.from_model`` wraps a model already built. device: 'auto' | 'cpu' | 'cuda'.
    dtype: 'auto' | 'float32' | 'bfloat16' | 'float16'. max_model_len: longest prompt + output (default: the
    model's, capped at 8192). block_size, num_kv_blocks, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, enforce_eager, gpu_memory_utilization, kv_cache_memory: the engine settings (defaults and
    meaning: the fields of ``CacheConfig``, ``SchedulerConfig``, ``EngineConfig``; every value is checked before the
    weights load). The KV pool is sized after the weights load, before CUDA graphs are captured
    (``sparrow.engine.kv_budget``; ``llm.engine.runner.kv_pool``): InsufficientMemoryError when it cannot hold one
    sequence of max_model_len tokens.
    quantization: None or a registered weight format (``sparrow.quant.supported_quantization()``; 'fp8':
    quantize a float checkpoint's linear layers and experts to block-scaled FP8 at load); a quantized
    checkpoint, declared by config.json's quantization_config, loads in its format (quantization None, that
    format's name or the checkpoint's quant_method such as 'gptq' / 'AWQ', any case, as vLLM takes them; another
    name raises InvalidRequestError).
    quantize_lm_head: with FP8 linears, compute the logits on a block-scaled FP8 copy of the LM head too (off by
    default, as in vLLM: it halves the LM head's bytes and rounds the logits; see ``CausalLM.quantize_lm_head``).
    speculative_config: vLLM's dict, e.g. {'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_max': 4,
    'prompt_lookup_min': 2} or {'method': 'draft_model', 'model': PATH, 'num_speculative_tokens': 4} (fields:
    ``sparrow.config.SpeculativeConfig``); None: no speculation. Outputs follow the target's distribution
    (greedy: the tokens of plain decoding).
    enable_lora, max_loras, max_lora_rank, max_cpu_loras: serve PEFT LoRA adapters (``generate(...,
    lora_request=LoRARequest(name, int_id, path))``, ``sparrow.lora``): at most max_loras adapters on the device at
    once (loaded on demand, least recently used evicted), ranks up to max_lora_rank, at most max_cpu_loras adapters
    in host memory (default max_loras; the least recently used one in no slot is dropped and read again from its
    folder when needed: ``sparrow.lora.manager``).
    kv_cache_dtype: 'auto' (the model dtype), 'fp8' or 'fp8_e4m3' (vLLM's names): e4m3 KV storage with one k and one
    v scale per layer, read and applied inside the attention kernels (about twice the tokens in the same memory);
    the scales are the checkpoint's k_scale / v_scale where it has them, else 1.0, or with calculate_kv_scales=True
    measured on the first prefill; kv_cache_dtype_skip_layers: layers kept in the model dtype ('sliding_window' and
    / or attention-layer indices; ``sparrow.kv_cache``).
    tensor_parallel_size, enable_expert_parallel (vLLM's names; ``ParallelConfig``): split the model over that many
    processes; this one is rank 0 (scheduler, sampler, outputs) and sparrow spawns the others, each loading the same
    model with the same arguments (on CUDA rank r uses cuda:r; on the CPU gloo). ``close()`` stops them (so do
    garbage collection and exit); a failing worker raises WorkerError naming its rank and error; a draft-model
    speculative config is refused (``sparrow.engine.workers``).
    tokenizer: a transformers tokenizer to use instead of the model's; skip_tokenizer_init=True runs without one.
    seed: seeds torch's global generator before loading and the sampler's generator that requests without their
    own ``SamplingParams.seed`` draw from (vLLM's ``seed``): a fresh LLM with the same seed, given the same
    requests in the same order, samples the same tokens (on the same device and dtype).
    Raises sparrow errors (ModelNotFoundError, ModelLoadError, UnsupportedArchitectureError,
    InvalidRequestError, ...)."""

    def __init__(self, model: str | os.PathLike | None = None, device: str = _E.device, dtype: str = _E.dtype,
                 max_model_len: int | None = _E.max_model_len, quantization: str | None = None,
                 block_size: int = _C.block_size, max_num_seqs: int = _S.max_num_seqs,
                 max_num_batched_tokens: int = _S.max_num_batched_tokens, enforce_eager: bool = _E.enforce_eager,
                 num_kv_blocks: int | None = _C.num_blocks, enable_prefix_caching: bool = _C.enable_prefix_caching,
                 seed: int = 0, tokenizer=None, skip_tokenizer_init: bool = False, quantize_lm_head: bool = False,
                 gpu_memory_utilization: float = _C.gpu_memory_utilization,
                 kv_cache_memory: int | str | None = _C.kv_cache_memory, speculative_config: dict | None = None,
                 enable_lora: bool = False, max_loras: int = LoRAConfig.max_loras,
                 max_lora_rank: int = LoRAConfig.max_lora_rank, max_cpu_loras: int | None = LoRAConfig.max_cpu_loras,
                 kv_cache_dtype: str = _C.kv_cache_dtype, calculate_kv_scales: bool = _C.calculate_kv_scales,
                 kv_cache_dtype_skip_layers=_C.kv_cache_dtype_skip_layers,
                 tensor_parallel_size: int = _P.tensor_parallel_size,
                 enable_expert_parallel: bool = _P.enable_expert_parallel):
        from sparrow.default_model import default_model_path
        from sparrow.loader.model_loader import load_model, read_model_config
        from sparrow.quant import check_quantization
        from sparrow.tokenizer import load_tokenizer

        start = time.perf_counter()
        ensure_cpu_threads()  # devices.default_cpu_threads unless the process chose a count
        check_quantization(quantization)  # InvalidRequestError naming the registered formats
        if isinstance(model, torch.nn.Module):
            raise InvalidRequestError("model is a built torch module: use LLM.from_model(model, ...) for it")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise InvalidRequestError(f"model={model!r} must be a path (str) or None for the packaged default")
        path = os.fspath(model if model is not None else default_model_path())
        # every engine argument is checked against the model's config (read without the weights) before loading
        config = engine_config(
            read_model_config(path)[0], device=device, dtype=dtype, max_model_len=max_model_len,
            block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=kv_cache_memory,
            speculative_config=speculative_config, enable_lora=enable_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras, kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales, kv_cache_dtype_skip_layers=kv_cache_dtype_skip_layers,
            tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=enable_expert_parallel)
        torch.manual_seed(seed)
        build = functools.partial(load_model_module, path, TORCH_DTYPES[config.dtype], quantization, quantize_lm_head)
        workers = _start_workers(config, build, seed)
        with _starting(workers):
            reset_peak_memory(config.device)
            loaded = load_model(path, TORCH_DTYPES[config.dtype], config.device, quantization=quantization,
                                quantize_lm_head=quantize_lm_head)
            load_peak = peak_memory(config.device)
            # skip_tokenizer_init (vLLM's name): no tokenizer; prompts must be {'prompt_token_ids': [...]}, no text
            if tokenizer is None and not skip_tokenizer_init:
                tokenizer = load_tokenizer(path)
            self._start(config.replace(model=loaded.config), loaded.model, tokenizer, path, seed, workers)
        self.load_time = time.perf_counter() - start
        self.load_peak_memory = load_peak

    @staticmethod
    def _load_draft(config: EngineConfig) -> torch.nn.Module | None:
        """The draft model of a 'draft_model' speculative config, loaded on the target's device and dtype."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        from sparrow.loader.model_loader import load_model

        return load_model(spec.model, TORCH_DTYPES[config.dtype], config.device).model

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer=None, **engine_args) -> "LLM":
        """An LLM around a sparrow model that is already built and loaded (a ``sparrow.models`` class whose
        ``config`` is a ModelConfig, after ``loader.model_loader.finish_loading``), e.g. random weights copied
        from a transformers model. ``engine_args``: LLM's engine arguments (device, dtype, max_model_len,
        block_size, num_kv_blocks, enable_prefix_caching, max_num_seqs, max_num_batched_tokens, enforce_eager,
        gpu_memory_utilization, kv_cache_memory, speculative_config, enable_lora, max_loras, max_lora_rank,
        max_cpu_loras, kv_cache_dtype, calculate_kv_scales, kv_cache_dtype_skip_layers);
        device and dtype ('auto' or left out) are the model's own (``_model_placement``). tokenizer: None runs
        without one (prompts as {'prompt_token_ids': [...]}). Raises InvalidRequestError for a model that is not
        a sparrow model, a device or dtype other than the model's, or a bad engine argument; TypeError for an
        unknown argument."""
        config = getattr(model, "config", None)
        if not isinstance(model, torch.nn.Module) or not isinstance(config, ModelConfig):
            raise InvalidRequestError(f"LLM.from_model needs a sparrow model (a torch module whose .config is a "
                                      f"ModelConfig), got {type(model).__name__}")
        device, dtype = _model_placement(model)
        for name, own in (("device", device), ("dtype", dtype)):
            if engine_args.get(name, "auto") == "auto":
                engine_args[name] = own
        built = engine_config(config, **engine_args)
        if built.parallel.world_size > 1:
            raise InvalidRequestError(f"LLM.from_model runs on one rank (a model built in this process is not split "
                                      f"over ranks): for tensor_parallel_size={built.parallel.world_size} use "
                                      "LLM(path, ...) or LLM.from_builder")
        _check_no_group()
        if torch.device(built.device).type != torch.device(device).type or built.dtype != dtype:
            raise InvalidRequestError(f"device={built.device!r}, dtype={built.dtype!r} do not match the model's "
                                      f"weights ({device}, {dtype})")
        llm = cls.__new__(cls)
        llm._start(built, model, tokenizer, None)
        return llm

    @classmethod
    def from_builder(cls, build, model_config: ModelConfig, tokenizer=None, seed: int | None = None,
                     **engine_args) -> "LLM":
        """An LLM around the model ``build(device)`` returns (a loaded sparrow model on ``device``, as
        ``from_model`` takes one). ``build`` must be picklable (a top-level function, or a functools.partial of
        one): with tensor_parallel_size=N every rank calls it in its own process, after the group formed (rank r
        with its device: cuda:r, or 'cpu'), so each builds its shard. ``model_config``: the model's ModelConfig
        (the engine arguments are checked against it before any rank builds). ``seed``: torch.manual_seed before
        building (on every rank) and the sampler's seed, as LLM's (None: neither, as ``from_model``). ``engine_args``: LLM's engine arguments
        (``from_model``'s list, plus tensor_parallel_size and enable_expert_parallel). Raises what ``build``
        raises (WorkerError when a worker's build fails) and InvalidRequestError for a bad engine argument."""
        config = engine_config(model_config, **engine_args)
        if seed is not None:
            torch.manual_seed(seed)
        workers = _start_workers(config, build, seed)
        llm = cls.__new__(cls)
        with _starting(workers):
            model = build(config.device)
            own = getattr(model, "config", None)
            llm._start(config.replace(model=own) if isinstance(own, ModelConfig) else config, model, tokenizer,
                       None, seed, workers)
        return llm

    def _start(self, config: EngineConfig, model: torch.nn.Module, tokenizer, path: str | None,
               seed: int | None = None, workers=None) -> None:
        ensure_cpu_threads()
        self.tokenizer = tokenizer
        self._workers = workers
        """The tensor-parallel ranks 1..N-1 (``sparrow.engine.workers.WorkerGroup``) when this LLM has several;
        stopped by ``close``, by garbage collection of the engine (``llm.engine``, kept alive by the LLM) and at
        exit."""
        self.engine = Engine(config, model, tokenizer, draft_model=self._load_draft(config),
                             make_speculator=make_speculative_decoder, workers=workers)
        if workers is not None:
            weakref.finalize(self.engine, workers.shutdown)
        self.engine.runner.sampler.reseed(seed)
        self.model_path = path
        self.load_time: float | None = None
        """Seconds the constructor took (config, weights, tokenizer, KV pool); None for ``from_model``."""
        self.load_peak_memory: int | None = None
        """Peak bytes while the weights loaded (``devices.peak_memory``: torch's allocator on CUDA, the process's
        RSS on the CPU); None for ``from_model``."""
        self.last_output: RequestOutput | None = None
        """The final RequestOutput of the latest ``stream`` that ran to its end (its ``metrics`` included)."""
        self._watched: dict[str, RequestOutput | None] = {}
        """Latest output of each request a ``generate`` or ``stream`` call is waiting on (None before its first):
        whichever call steps the engine records them, so interleaved calls lose nothing."""
        self._finished_counts = {"prompt_tokens": 0, "generation_tokens": 0}
        self._request_success: dict[str, int] = {}

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank, and after the first call); the LLM cannot
        generate afterwards when it had several ranks."""
        workers = getattr(self, "_workers", None)
        if workers is not None:
            workers.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string, a dict with 'prompt_token_ids', or a list of "
                                      f"them; got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if any(not isinstance(sp, SamplingParams) for sp in sampling_params):
            raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them")
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts (give one, or one per prompt)")
        return prompts, sampling_params

    def _step(self) -> None:
        """One engine step, recording the outputs of the requests in ``_watched``."""
        for out in self.engine.step():
            if out.request_id in self._watched:
                self._watched[out.request_id] = out
            if out.finished:
                self._count_finished(out)

    def _count_finished(self, out: RequestOutput) -> None:
        self._finished_counts["prompt_tokens"] += len(out.prompt_token_ids)
        for c in out.outputs:
            self._finished_counts["generation_tokens"] += len(c.token_ids)
            self._request_success[c.finish_reason] = self._request_success.get(c.finish_reason, 0) + 1

    def get_metrics(self) -> dict:
        """The engine's counters under the server's metric names (vLLM's, ``sparrow:`` prefix): gauges
        num_requests_running / num_requests_waiting (sequences), kv_cache_usage_perc (fraction of blocks held,
        in [0, 1]); counters since construction: num_preemptions, prefix_cache_queries / prefix_cache_hits
        (prompt tokens), and over the requests finished through this LLM: prompt_tokens, generation_tokens,
        request_success ({finish_reason: completions}); with LoRA on, lora_requests_info ({"running_lora_adapters" /
        "waiting_lora_adapters": the adapter names of the running / waiting sequences, comma-separated, each once,
        in queue order; "max_lora": max_loras, an int), the server gauge's labels. A snapshot: later steps do not
        change it."""
        e = self.engine
        bm = e.block_manager
        lora = {}
        if self.config.lora is not None:
            running, waiting = e.scheduler.lora_adapter_names()
            lora["sparrow:lora_requests_info"] = {"running_lora_adapters": ",".join(running),
                                                  "waiting_lora_adapters": ",".join(waiting),
                                                  "max_lora": self.config.lora.max_loras}
        return {
            "sparrow:num_requests_running": len(e.scheduler.running),
            "sparrow:num_requests_waiting": len(e.scheduler.waiting),
            "sparrow:kv_cache_usage_perc": bm.usage,
            "sparrow:num_preemptions": e.scheduler.num_preemptions,
            "sparrow:prefix_cache_queries": bm.prefix_cache_queries,
            "sparrow:prefix_cache_hits": bm.prefix_cache_hits,
            **{f"sparrow:{k}": v for k, v in self._finished_counts.items()},
            "sparrow:request_success": dict(self._request_success),
            **(e.spec.metrics() if e.spec is not None else {}),
            **lora,
        }

    def _aborted(self, rid: str) -> bool:
        """Whether ``rid`` left the engine without finishing (aborted by the engine: a step it was in raised, or its
        LoRA adapter could not be read again)."""
        out = self._watched.get(rid)
        return (out is None or not out.finished) and rid not in self.engine.requests

    def _raise_aborted(self, rid: str):
        """Raise why ``rid`` left the engine unfinished: its error (``Engine.failed``), else RuntimeError."""
        error = self.engine.failed.pop(rid, None)
        if error is not None:
            raise error
        raise RuntimeError(f"request {rid} was aborted: a step it was part of was interrupted or failed")

    def _release(self, rid: str) -> None:
        """Stop waiting on ``rid``; abort it when it has not finished (an exception or an abandoned stream)."""
        out = self._watched.pop(rid, None)
        self.engine.failed.pop(rid, None)
        if (out is None or not out.finished) and rid in self.engine.requests:
            self.engine.abort(rid)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, or {'prompt_token_ids': [...]}); results in prompt order.
        ``lora_request``: a LoRARequest for every prompt, or a list of one per prompt (None: the base model);
        needs ``enable_lora=True``. If a prompt or adapter is bad, the call raises and its requests added so far
        are aborted (also LoRAAdapterError for an adapter whose host copy was dropped and whose folder cannot be
        read again when its request reaches a step). Requests of an unfinished ``stream`` keep running and keep
        their outputs; if this call raises (or is interrupted), its own requests are aborted."""
        prompts, params = self._normalize(prompts, sampling_params)
        loras = _per_prompt_loras(lora_request, len(prompts))
        ids: list[str] = []
        try:
            for p, sp, lr in zip(prompts, params, loras):
                ids.append(self.engine.add_request(p, sp, lora_request=lr))
                self._watched[ids[-1]] = None
            bar = None
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(ids), desc="generating")
            finished = 0
            while True:
                now = sum(1 for r in ids if self._watched[r] is not None and self._watched[r].finished)
                if bar:
                    bar.update(now - finished)
                finished = now
                if finished == len(ids):
                    break
                gone = [r for r in ids if self._aborted(r)]
                if gone:
                    self._raise_aborted(gone[0])
                self._step()
            if bar:
                bar.close()
            return [self._watched[r] for r in ids]
        finally:
            for rid in ids:
                self._release(rid)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, lora_request=None) -> Iterator[str]:
        """Yield the text of one prompt's first completion as it is generated (new text per step). The engine
        holds back text a stop string may still remove, so the pieces always join to the final text. Closing
        the iterator early aborts the request. ``lora_request``: a LoRARequest, or None for the base model."""
        rid = self.engine.add_request(prompt, sampling_params or SamplingParams(), lora_request=lora_request)
        self._watched[rid] = None
        sent = 0
        try:
            while True:
                out = self._watched[rid]
                if out is not None:
                    text = out.outputs[0].text
                    if len(text) > sent:
                        piece, sent = text[sent:], len(text)
                        yield piece
                        continue  # read again: a generate() between two pieces may have stepped the engine
                    if out.finished:
                        self.last_output = out
                        return
                if self._aborted(rid):
                    self._raise_aborted(rid)
                self._step()
        finally:
            self._release(rid)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             lora_request=None, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to a conversation (a list of {'role': str, 'content': str}), or to each
        of a list of conversations, rendered with the model's chat template; one RequestOutput per conversation,
        in order (vLLM's ``LLM.chat``). ``sampling_params`` and ``lora_request`` as ``generate`` takes them (one
        for all, or one per conversation; LoRARequest or None for the base model); ``chat_template``,
        ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``: vLLM's, as
        ``sparrow.tokenizer.apply_chat_template`` takes them. Raises InvalidRequestError when
        the model has no template, the messages are malformed or the template refuses them (its own message
        quoted), ModelLoadError when the template itself is broken (``sparrow.tokenizer.apply_chat_template``)."""
        from sparrow.tokenizer import apply_chat_template

        batch = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = list(messages) if batch else [messages]
        kw = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                  chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        return self.generate([apply_chat_template(self.tokenizer, c, **kw) for c in conversations], sampling_params,
                             lora_request=lora_request)
