"""Frozen configuration dataclasses, normalized once.

- ``model``: ``ModelConfig`` / ``LayerSpec``, from HF config.json (``from_hf``) or GGUF metadata (``from_gguf``);
  ``hf_fields``, ``gguf`` and ``architectures`` are its readers and the table of supported architectures;
- ``engine``: CacheConfig, SchedulerConfig, LoRAConfig, EngineConfig, which validate themselves and hold the
  engine's defaults; ``speculative``: SpeculativeConfig;
- ``values``: the checks and parsers of single values (sizes, the KV cache dtype) they share.

The config package sits below every package that runs a model: it imports none of them (the kernels' table of
activations aside), so a config can be read and checked before anything is built.
"""
from sparrow.config.engine import DEFAULT_MAX_MODEL_LEN_CAP, EXPERT_DISPATCH_MODES, CacheConfig, EngineConfig, \
    LoRAConfig, ParallelConfig, SchedulerConfig
from sparrow.config.model import LayerSpec, ModelConfig
from sparrow.config.speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SpeculativeConfig
from sparrow.devices import TORCH_DTYPES  # re-exported: EngineConfig.dtype name -> torch dtype

__all__ = [
    "DEFAULT_MAX_MODEL_LEN_CAP", "EXPERT_DISPATCH_MODES", "MAX_SPECULATIVE_TOKENS", "SPECULATIVE_METHODS", "TORCH_DTYPES", "CacheConfig",
    "EngineConfig", "LayerSpec", "LoRAConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig",
]
