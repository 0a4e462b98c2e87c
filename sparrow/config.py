"""Frozen configuration dataclasses, normalized once (style.md 3).

``ModelConfig.from_hf`` turns an HF ``config.json`` dict (any supported architecture, transformers 4 or 5
field names) into explicit fields; ``from_gguf`` first maps GGUF metadata onto HF names
(``sparrow.loader.gguf.hf_config_from_gguf``), then calls it. The engine configs (CacheConfig, SchedulerConfig,
EngineConfig) validate themselves when built and are the single source of the engine's defaults.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from sparrow.devices import TORCH_DTYPES  # noqa: F401  (re-exported: EngineConfig.dtype name -> torch dtype)
from sparrow.errors import InvalidRequestError, ModelLoadError
from sparrow.loader.hf_config import check_fields, check_gemma4, gemma4_layer_shape, moe_fields


def _rope_for(cfg: dict, layer_type: str | None) -> dict:
    """The rope parameters ({rope_theta, rope_type, ...}) of a layer type, from transformers 5's
    ``rope_parameters`` (flat or keyed by layer type) or transformers 4's rope_theta / rope_scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            return dict(params[layer_type])
        if "rope_theta" in params or "rope_type" in params:
            return dict(params)
        if isinstance(params.get("full_attention"), dict):
            return dict(params["full_attention"])
    out = dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", 10000.0)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        out = {}
        theta = cfg["rope_local_base_freq"]
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = theta
    return out


def _rotary_dim(cfg: dict, rope: dict, head_dim: int) -> int:
    """Rotated dims per head: the whole head for Gemma 4's 'proportional' rope (its zero frequencies do the
    partial part), else head_dim x partial_rotary_factor (or MiniMax's legacy ``rotary_dim``)."""
    if rope.get("rope_type") == "proportional":
        return head_dim
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None and cfg.get("rotary_dim"):
        return int(cfg["rotary_dim"])
    return int(head_dim * float(factor if factor is not None else 1.0))


@dataclass(frozen=True)
class LayerSpec:
    """Attention shape of one decoder layer (layers may differ: Gemma 3/4 sliding vs full)."""

    layer_type: str
    """'sliding_attention' or 'full_attention'."""
    num_kv_heads: int
    """KV heads of this layer."""
    head_dim: int
    """Head dim of q, k and v in this layer."""
    sliding_window: int | None
    """Window W (query i sees keys j with i - W < j <= i), or None for full attention."""
    rope: dict
    """Rope parameters of this layer: rope_theta, rope_type, and the type's own fields."""
    rotary_dim: int | None = None
    """Leading dims of each head that RoPE rotates (partial rotary); None = the whole head."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder model's shape and numerics, normalized from HF config.json or GGUF metadata."""

    architecture: str
    """HF architecture name, e.g. 'Gemma3ForCausalLM'; keys the model registry."""
    model_type: str
    """HF model_type, e.g. 'gemma3_text', 'llama'."""
    vocab_size: int
    """Rows of the embedding table and LM head."""
    hidden_size: int
    """Residual stream width H."""
    intermediate_size: int
    """Dense MLP width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (GQA) of the default layer type."""
    head_dim: int
    """Head dim of the default layer type."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    max_position_embeddings: int
    """Longest context the model was trained for."""
    hidden_act: str
    """MLP activation, HF name ('silu', 'gelu_pytorch_tanh')."""
    tie_word_embeddings: bool
    """LM head shares the embedding table."""
    layers: tuple[LayerSpec, ...]
    """Per-layer attention shape, window and rope."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3/4)."""
    attn_scale: float | None = None
    """Attention score scale; None means head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """tanh soft-cap on attention scores (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """tanh soft-cap on the final logits (Gemma 2/4)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end generation."""
    qk_norm_per_head: bool = True
    """q/k norms act per head ([D] weights); False: one norm over all heads' q (and k), MiniMax-M2."""
    attention_k_eq_v: bool = False
    """Full-attention layers have no v_proj: V is the K projection (before k_norm), Gemma 4."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each row is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width I of one routed expert."""
    norm_topk_prob: bool = False
    """Renormalize the top-k router weights to sum to 1."""
    shared_expert_intermediate_size: int = 0
    """Width of the sigmoid-gated shared expert (Qwen2-MoE); 0 = none."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP in an MoE model (Qwen2/3-MoE)."""
    router_scoring: str = "softmax"
    """Router scoring function: 'softmax', 'sigmoid' or 'sqrtsoftplus'."""
    router_correction_bias: bool = False
    """The router has e_score_correction_bias (selects experts, does not weigh them)."""
    n_group: int | None = None
    """Expert groups for grouped top-k (DeepSeek-V3); None = no grouping."""
    topk_group: int | None = None
    """Groups kept by grouped top-k."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' weights."""
    moe_pair_threshold: int = 64
    """More (row, expert) pairs than this take the grouped expert path, otherwise the per-pair path."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    """The HF config dict this was built from (architecture-specific extras live here)."""

    @property
    def is_gemma(self) -> bool:
        """Gemma conventions: scaled embedding, GELU-tanh MLP, sandwich norms."""
        return self.model_type.startswith("gemma")

    @property
    def norm_kind(self) -> str:
        """RMSNorm weight convention: 'gemma' (1 + w, Gemma 2/3), 'gemma4' (w in fp32), 'llama' (w after the cast)."""
        if self.model_type.startswith("gemma4"):
            return "gemma4"
        return "gemma" if self.is_gemma else "llama"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` has routed experts."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def get(self, key: str, default: Any = None) -> Any:
        """An extra field from the HF config (for architecture-specific options)."""
        return self.raw.get(key, default)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Normalize an HF config.json dict. Raises UnsupportedArchitectureError / ModelLoadError (a value of
        the wrong type or out of range names ``source`` and the field: ``sparrow.loader.hf_config.check_fields``)."""
        from sparrow.models.registry import resolve_architecture

        check_fields(cfg, source)
        cfg = dict(cfg)
        if "text_config" in cfg and isinstance(cfg["text_config"], dict) and "hidden_size" not in cfg:
            text = dict(cfg["text_config"])
            text.setdefault("architectures", cfg.get("architectures"))
            text["_multimodal"] = True
            check_fields(text, f"{source} text_config")
            cfg = text
        arch = resolve_architecture(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ModelLoadError(f"config of {arch} lacks the field {e.args[0]!r}") from None
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        model_type = cfg.get("model_type", "")
        layer_types = cfg.get("layer_types")
        window = cfg.get("sliding_window")
        if not layer_types:
            if window and model_type.startswith("gemma3"):
                pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
                ]
            elif window and cfg.get("use_sliding_window", True) and model_type in ("mistral", "mixtral"):
                layer_types = ["sliding_attention"] * n_layers
            else:
                layer_types = ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise ModelLoadError(f"config.layer_types has {len(layer_types)} entries for {n_layers} layers")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            layer_types = ["full_attention"] * n_layers
        elif model_type == "qwen3_moe" and window and not cfg.get("layer_types"):
            layer_types = ["sliding_attention"] * n_layers  # Qwen3MoeModel: one window for every layer
        if model_type.startswith("gemma4"):
            check_gemma4(cfg)
        layers = []
        for i, t in enumerate(layer_types):
            kv_i, d_i = n_kv, head_dim
            if model_type.startswith("gemma4"):
                kv_i, d_i = gemma4_layer_shape(cfg, i, t, n_kv, head_dim)
            rope = _rope_for(cfg, t)
            layers.append(LayerSpec(
                layer_type=t,
                num_kv_heads=kv_i,
                head_dim=d_i,
                sliding_window=int(window) if t == "sliding_attention" and window else None,
                rope=rope,
                rotary_dim=_rotary_dim(cfg, rope, d_i),
            ))
        layers = tuple(layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        scalar = cfg.get("query_pre_attn_scalar")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        from sparrow.layers.activation import ACTIVATIONS

        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ModelLoadError(f"config.json has hidden_act={act!r}; sparrow supports {sorted(ACTIVATIONS)}")
        positions = cfg.get("max_position_embeddings")
        if isinstance(positions, float) and positions.is_integer():
            positions = int(positions)  # 2048.0: accepted as before
        if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 2):
            raise ModelLoadError(f"config.json has max_position_embeddings={positions!r}; it must be an integer >= 2")
        is_gemma = model_type.startswith("gemma")
        moe = moe_fields(cfg, model_type)
        if model_type.startswith("gemma4"):
            scalar = None
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=positions or 4096,
            hidden_act=act,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
            layers=layers,
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "minimax_m2") or model_type.startswith(("gemma3", "gemma4")),
            qk_norm_per_head=model_type != "minimax_m2",
            attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
            attn_scale=1.0 if model_type.startswith("gemma4") else (float(scalar) ** -0.5 if scalar else None),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
            raw=cfg,
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str] | None = None) -> "ModelConfig":
        """Normalize GGUF metadata: ``sparrow.loader.gguf.hf_config_from_gguf`` (its docstring lists the rule for
        each field the metadata lacks), then ``from_hf``. Raises UnsupportedArchitectureError / ModelLoadError."""
        from sparrow.loader.gguf import hf_config_from_gguf

        return cls.from_hf(hf_config_from_gguf(metadata, tensor_names), source="the GGUF metadata (as HF fields)")


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    """Raise InvalidRequestError unless ``value`` is an int (not a bool) >= ``minimum``; the message names it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise InvalidRequestError(f"{name}={value} must be at least {minimum}")


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
        from sparrow.kv_cache.cache import check_kv_cache_dtype, parse_skip_layers

        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.calculate_kv_scales, bool):
            raise InvalidRequestError(f"calculate_kv_scales={self.calculate_kv_scales!r} must be True or False")
        # frozen: the normalized tuple, set once here
        object.__setattr__(self, "kv_cache_dtype_skip_layers", parse_skip_layers(self.kv_cache_dtype_skip_layers))
        _check_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size={self.block_size} must be a power of two")
        if self.num_blocks is not None:
            _check_int("num_kv_blocks", self.num_blocks)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise InvalidRequestError(f"gpu_memory_utilization={u!r} must be a number in (0, 1]")
        _check_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        if self.kv_cache_memory is not None:
            from sparrow.engine.kv_budget import parse_size

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
        _check_int("max_num_seqs", self.max_num_seqs)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens)


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
        _check_int("max_loras", self.max_loras)
        _check_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)  # frozen: the resolved value, set once here
        _check_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras="
                                      f"{self.max_loras}")


MAX_SPECULATIVE_TOKENS = 15
"""Most draft tokens per verify step (k + 1 <= 16 rows per sequence: the range of the small-row kernels)."""

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): a proposer drafts up to ``num_speculative_tokens``
    tokens per sequence and step, the target verifies them in one step of k + 1 rows. Built from a dict by
    ``from_dict``; raises InvalidRequestError naming the bad key or value."""

    method: str
    """'ngram' (prompt lookup: the tokens after the latest earlier occurrence of the context's last n tokens) or
    'draft_model' (a smaller model with the target's vocabulary, greedy, with its own KV cache)."""
    num_speculative_tokens: int
    """k: most draft tokens verified per sequence and step (1 .. MAX_SPECULATIVE_TOKENS)."""
    prompt_lookup_max: int = 4
    """ngram: longest suffix n looked up (tried first)."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix n looked up."""
    model: str | None = None
    """draft_model: path of the draft model (HF folder or .gguf)."""

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative_config method={self.method!r} is not supported "
                                      f"(supported: {', '.join(SPECULATIVE_METHODS)})")
        _check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(f"speculative_config num_speculative_tokens={self.num_speculative_tokens} "
                                      f"exceeds {MAX_SPECULATIVE_TOKENS}")
        _check_int("speculative_config prompt_lookup_min", self.prompt_lookup_min)
        _check_int("speculative_config prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                                      f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise InvalidRequestError("speculative_config method='draft_model' needs 'model' (the draft's path)")
        if self.method == "ngram" and self.model is not None:
            raise InvalidRequestError("speculative_config method='ngram' takes no 'model'")

    @classmethod
    def from_dict(cls, spec: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The config of vLLM's dict form, e.g. {'method': 'ngram', 'num_speculative_tokens': 4,
        'prompt_lookup_max': 4, 'prompt_lookup_min': 2} or {'method': 'draft_model', 'model': PATH,
        'num_speculative_tokens': 4} ('method' may be left out when 'model' is given); None stays None."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                                      f"(known: {', '.join(sorted(known))})")
        spec = dict(spec)
        if "method" not in spec:
            if not spec.get("model"):
                raise InvalidRequestError("speculative_config needs 'method' ('ngram' or 'draft_model')")
            spec["method"] = "draft_model"
        if "num_speculative_tokens" not in spec:
            raise InvalidRequestError("speculative_config needs 'num_speculative_tokens'")
        if spec.get("model") is not None and not isinstance(spec["model"], (str, os.PathLike)):
            raise InvalidRequestError(f"speculative_config model={spec['model']!r} must be a path")
        if spec.get("model") is not None:
            spec["model"] = os.fspath(spec["model"])
        return cls(**spec)


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

    def __post_init__(self):
        from sparrow.devices import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        if dtype == "float16" and device == "cpu":
            raise InvalidRequestError("dtype='float16' is not supported on the CPU (use 'float32' or 'bfloat16')")
        limit, mml = self.model.max_position_embeddings, self.max_model_len
        if mml is None:
            mml = min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        _check_int("max_model_len", mml)
        if mml > limit:
            raise InvalidRequestError(f"max_model_len={mml} exceeds the model's {limit} positions")
        _check_int("max_model_len", mml, minimum=2)
        n, bs = self.cache.num_blocks, self.cache.block_size
        if n is not None and n * bs < mml:
            raise InvalidRequestError(f"num_kv_blocks={n} of {bs} tokens cannot hold one sequence of "
                                      f"max_model_len={mml} tokens")
        for name, value in (("device", device), ("dtype", dtype), ("max_model_len", mml)):
            object.__setattr__(self, name, value)  # frozen: the resolved values, set once here

    def replace(self, **kw: Any) -> "EngineConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **kw)
