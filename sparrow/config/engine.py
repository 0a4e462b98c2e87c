"""The engine's configs: CacheConfig (the paged KV pool), SchedulerConfig (batching limits), LoRAConfig
(multi-LoRA) and EngineConfig (everything the engine needs besides the weights). They validate themselves when
built (InvalidRequestError naming the argument as LLM names it) and are the single source of the engine's
defaults."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sparrow.config.model import ModelConfig
from sparrow.config.speculative import SpeculativeConfig
from sparrow.config.values import check_int, check_kv_cache_dtype, parse_size, parse_skip_layers
from sparrow.devices import resolve_device, resolve_dtype
from sparrow.errors import InvalidRequestError


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings. Raises InvalidRequestError for a value out of range (named as LLM names it)."""

    block_size: int = 16
    """Tokens per KV block (a power of two >= 1)."""
    num_blocks: int | None = None
    """Blocks in the pool per layer (LLM's ``num_kv_blocks``), authoritative; None sizes the pool from the memory
    settings (``sparrow.engine.kv_budget``)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory the engine may use (weights + CUDA graphs + KV pool), in (0, 1]."""
    kv_cache_memory: int | None = None
    """Bytes of the KV pool (an int, or a string such as '8GiB', '8G', '512MiB', read as bytes); overrides
    gpu_memory_utilization (and cpu_kv_cache_bytes on CPU); not with num_kv_blocks."""
    cpu_kv_cache_bytes: int = 1 << 30
    """Most bytes of the KV pool on CPU without kv_cache_memory."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    kv_cache_dtype: str = "auto"
    """KV storage: 'auto' (the model dtype), 'fp8' or 'fp8_e4m3' (e4m3 with per-layer k/v scales: half the bytes)."""
    calculate_kv_scales: bool = False
    """FP8 KV: measure each layer's k/v scales on the first prefill (amax / 448), else checkpoint's or 1.0."""
    kv_cache_dtype_skip_layers: tuple = ()
    """FP8 KV: layers kept in the model dtype: 'sliding_window' and / or attention-layer indices."""

    def __post_init__(self):
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.calculate_kv_scales, bool):
            raise InvalidRequestError(f"calculate_kv_scales={self.calculate_kv_scales!r} must be True or False")
        # frozen: the normalized tuple, set once here
        object.__setattr__(self, "kv_cache_dtype_skip_layers", parse_skip_layers(self.kv_cache_dtype_skip_layers))
        check_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size={self.block_size} must be a power of two")
        if self.num_blocks is not None:
            check_int("num_kv_blocks", self.num_blocks)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise InvalidRequestError(f"gpu_memory_utilization={u!r} must be a number in (0, 1]")
        check_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))  # frozen: set once here
            if self.num_blocks is not None:
                raise InvalidRequestError(f"num_kv_blocks={self.num_blocks} and kv_cache_memory="
                                          f"{self.kv_cache_memory} both size the KV pool: give one")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits. Raises InvalidRequestError for a value below 1 or not an integer."""

    max_num_seqs: int = 64
    """Most sequences running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode rows)."""

    def __post_init__(self):
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``enable_lora`` arguments). Built, ``max_cpu_loras`` is an int. Raises
    InvalidRequestError (a ValueError) for a value below 1 or a max_cpu_loras below max_loras."""

    max_loras: int = 4
    """Adapters held on the device at once (slots); a step runs at most this many distinct adapters."""
    max_lora_rank: int = 64
    """Largest adapter rank accepted (the slot buffers' width per PEFT module)."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory, at least max_loras (default: max_loras); the least recently used one that no
    slot holds is dropped, and read again from its folder when needed."""

    def __post_init__(self):
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)  # frozen: the resolved value, set once here
        check_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras="
                                      f"{self.max_loras}")


EXPERT_DISPATCH_MODES = ("all_reduce", "all_to_all")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and expert parallelism over several processes (vLLM's ``tensor_parallel_size`` and
    ``enable_expert_parallel``). Raises InvalidRequestError for a size below 1 or an unknown dispatch mode."""

    tensor_parallel_size: int = 1
    """Processes (one GPU each on CUDA) that split every layer: attention heads, MLP widths, the vocabulary."""
    enable_expert_parallel: bool = False
    """MoE layers split their experts across the ranks (each rank holds whole experts) instead of splitting every
    expert's width; attention and dense layers stay tensor-parallel."""
    expert_dispatch: str = "all_reduce"
    """With expert parallelism: 'all_reduce' (every rank routes all tokens through its own experts, one all-reduce
    after the weighted sum) or 'all_to_all' (each token's rows are sent to the ranks holding its experts and the
    results returned to the token's rank)."""

    def __post_init__(self):
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.expert_dispatch not in EXPERT_DISPATCH_MODES:
            raise InvalidRequestError(f"expert_dispatch={self.expert_dispatch!r} is not one of "
                                      f"{', '.join(EXPERT_DISPATCH_MODES)}")

    @property
    def world_size(self) -> int:
        """Ranks (processes, one device each) the model spans: tensor_parallel_size (experts shard over the same
        ranks)."""
        return self.tensor_parallel_size


DEFAULT_MAX_MODEL_LEN_CAP = 8192
"""max_model_len=None takes the model's positions, at most this many (a smaller KV pool by default)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights. Built, it holds resolved values: device 'cpu' or
    'cuda[:N]', a dtype name of TORCH_DTYPES, an int max_model_len. Raises InvalidRequestError for an unknown
    device or dtype, float16 on the CPU, a max_model_len outside [2, the model's positions] and a KV pool
    (cache.num_blocks) that cannot hold one max_model_len sequence."""

    model: ModelConfig
    """The model's normalized config."""
    device: str = "auto"
    """'auto' (CUDA when a GPU is visible, else CPU), 'cpu' or 'cuda[:N]'."""
    dtype: str = "auto"
    """Compute dtype of weights and activations: 'auto' (bf16 on CUDA and on CPUs with native bf16, else
    fp32), 'float32', 'bfloat16' or 'float16'."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) accepted; None: the model's, capped at DEFAULT_MAX_MODEL_LEN_CAP."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """KV cache settings."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Batching limits."""
    enforce_eager: bool = False
    """Never capture CUDA graphs."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None: off."""
    lora: LoRAConfig | None = None
    """LoRA adapters (LLM's ``enable_lora``); None: off."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor / expert parallelism (one process per rank)."""

    def __post_init__(self):
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        if dtype == "float16" and device == "cpu":
            raise InvalidRequestError("dtype='float16' is not supported on the CPU (use 'float32' or 'bfloat16')")
        limit, mml = self.model.max_position_embeddings, self.max_model_len
        if mml is None:
            mml = min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        check_int("max_model_len", mml)
        if mml > limit:
            raise InvalidRequestError(f"max_model_len={mml} exceeds the model's {limit} positions")
        check_int("max_model_len", mml, minimum=2)
        n, bs = self.cache.num_blocks, self.cache.block_size
        if n is not None and n * bs < mml:
            raise InvalidRequestError(f"num_kv_blocks={n} of {bs} tokens cannot hold one sequence of "
                                      f"max_model_len={mml} tokens")
        for name, value in (("device", device), ("dtype", dtype), ("max_model_len", mml)):
            object.__setattr__(self, name, value)  # frozen: the resolved values, set once here

    def replace(self, **kw: Any) -> "EngineConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **kw)
