"""GGUF metadata -> an HF ``config.json``-style dict, for ``ModelConfig.from_gguf`` (the metadata half of
reading a GGUF checkpoint; its tensors are ``sparrow.loader.gguf``'s). Keys: gguf.md's names,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md."""
from __future__ import annotations

from typing import Any

from sparrow.config.gguf_moe import gemma4_fields, moe_fields
from sparrow.errors import ModelLoadError, UnsupportedArchitectureError

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
}
"""GGUF ``general.architecture`` -> the HF architecture name sparrow builds for it (a llama file with
``llama.expert_count`` > 0 is Mixtral: ``MixtralForCausalLM``)."""

_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
"""GGUF architecture -> HF model_type, where the two differ."""

GEMMA3_27B_BLOCKS = 62
"""Block count of Gemma 3 27B, the one Gemma 3 size whose query_pre_attn_scalar is not its head_dim."""


class _Metadata:
    """The ``{arch}.`` keys of GGUF metadata, read (``get``) and checked (``num``)."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.metadata, self.arch = metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def num(self, key: str, default: Any = None, kind: type = int, value: Any = None) -> Any:
        """``{arch}.key`` (or ``value`` read from it) as ``kind``; ModelLoadError naming the key for a value that
        is not a number >= 1 (a float key: > 0)."""
        v = self.get(key, default) if value is None else value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) \
                or (v < 1 if kind is int else not v > 0):
            raise ModelLoadError(f"GGUF metadata has {self.arch}.{key}={v!r}; it must be a "
                                 f"{'positive integer' if kind is int else 'positive number'}")
        return kind(v)

    def layer_values(self, key: str, default: Any = None) -> list:
        """``{arch}.key`` per layer: its array (one entry per block; ModelLoadError otherwise), or its scalar
        (``default`` when absent) repeated for every block."""
        v, n = self.get(key, default), self.num("block_count")
        if not isinstance(v, list):
            return [v] * n
        if len(v) != n:
            raise ModelLoadError(f"GGUF metadata has {self.arch}.{key} with {len(v)} entries for {n} blocks")
        return v

    def uniform(self, key: str, default: Any = None) -> int:
        """``{arch}.key`` as one positive integer: a scalar, or an array whose entries are all equal;
        ModelLoadError naming the key for differing per-layer values."""
        values = self.layer_values(key, default)
        if len(set(values)) > 1:
            raise ModelLoadError(f"GGUF metadata has per-layer {self.arch}.{key}={values}; sparrow builds "
                                 f"{self.arch} with one value for every layer")
        return self.num(key, value=values[0])


def hf_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str] | None = None,
                        rope_freqs: list[float] | None = None) -> dict[str, Any]:
    """An HF ``config.json``-style dict for GGUF ``metadata`` ({key: python value}, as ``GGUFCheckpoint``
    reads it), for ``ModelConfig.from_hf``.

    Read from the metadata (``{arch}.`` keys, gguf.md's names): embedding_length, block_count,
    attention.head_count, attention.head_count_kv (default: head_count), attention.key_length (default:
    embedding_length / head_count, llama.cpp's n_embd_head_k), feed_forward_length,
    attention.layer_norm_rms_epsilon (default 1e-6), context_length (default 4096), rope.freq_base
    (default 10000), vocab_size (default: the tokenizer's token count), tokenizer.ggml.bos/eos_token_id.

    Fields the metadata does not carry, one rule each (llama.cpp's ``llama_model::load_hparams`` is the
    reference loader):
    - tie_word_embeddings: the file has no ``output.weight`` (llama.cpp then reuses ``token_embd``); left to
      from_hf's default when ``tensor_names`` is None.
    - hidden_act: gelu_pytorch_tanh for gemma3 / gemma4 (GeGLU), silu for the others.
    - attention_bias (q/k/v biases): qwen2 and qwen2moe only; a bias tensor in another architecture's file is then an
      unused tensor, which the weight loader refuses.
    - attention scale: gemma3's query_pre_attn_scalar is hidden_size / num_attention_heads for the 27B
      (62 blocks: 5376 / 32 = 168, head_dim 128) and head_dim for every other size (270M, 1B, 4B, 12B:
      256), as llama.cpp keys it on the 27B and gemma_pytorch's configs set it; the others use head_dim ** -0.5.
    - gemma3 sliding attention: every 6th layer is full attention (sliding_window_pattern 6) and sliding
      layers use rope theta 10000 without scaling (rope_local_base_freq); the window itself is
      attention.sliding_window, required (512 for 270M / 1B, 1024 for 4B and up: no default fits all).
    - mistral: attention.sliding_window, when present, applies to every layer (HF's Mistral); absent, full
      attention. The other architectures ignore the key (HF's Llama / Qwen2 / Qwen3 default to full attention).
    - rope scaling: rope.scaling.type 'linear' (with rope.scaling.factor) maps to HF's linear rope_scaling;
      absent or 'none' is unscaled; another type (yarn, ...) is refused. Llama 3's frequency bands are not
      metadata but the ``rope_freqs.weight`` tensor, which the model loader applies.
    - rotary dims: rope.dimension_count, when present, must equal head_dim (partial rotary is refused).
    - per-layer arrays (feed_forward_length, attention.head_count_kv) must hold one value for every layer
      (Gemma 4's head_count_kv: one per layer type).
    - value head dim: attention.value_length, when present, must equal head_dim.

    - MoE (qwen2moe, qwen3moe, gemma4, llama with expert_count > 0 = Mixtral) and Gemma 4: the rules of
      ``sparrow.config.gguf_moe`` (its docstring lists them); ``tensor_names`` then also tells which layers
      have experts and checks that each has all its expert tensors, and ``rope_freqs`` (the values of the
      ``rope_freqs.weight`` tensor) gives Gemma 4's proportional RoPE.

    Raises UnsupportedArchitectureError for an architecture outside GGUF_ARCHITECTURES, ModelLoadError for
    missing shape keys, a numeric key that is not a positive number, or refused values (each named), and for
    a MoE file that lacks an expert tensor (named)."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    meta = _Metadata(metadata, arch)
    cfg = _shape_fields(meta)
    if tensor_names is not None:
        cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    _add_sliding_window(meta, cfg)
    if arch == "gemma4":
        cfg.update(gemma4_fields(meta, cfg, tensor_names, rope_freqs))
    cfg.update(moe_fields(meta, cfg, tensor_names))
    scaling = meta.get("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": meta.num("rope.scaling.factor", 1.0, float)}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF metadata has {arch}.rope.scaling.type={scaling!r}; sparrow supports 'linear' "
                             "and 'none'")
    return cfg


def _shape_fields(meta: _Metadata) -> dict[str, Any]:
    """The HF fields of the model's shape, norms, positions, tokens and activation (the rules of
    ``hf_config_from_gguf``); ModelLoadError for missing shape keys, no vocab size or refused head dims."""
    arch, m, num = meta.arch, meta.get, meta.num
    if any(m(k) is None for k in ("embedding_length", "attention.head_count", "block_count")):
        raise ModelLoadError(f"GGUF metadata lacks the {arch} shape keys (embedding_length, attention.head_count, "
                             "block_count)")
    hidden, n_heads, n_layers = num("embedding_length"), num("attention.head_count"), num("block_count")
    metadata = meta.metadata
    vocab = ((num("vocab_size") if m("vocab_size") is not None else None)
             or metadata.get("tokenizer.ggml.tokens.length")
             or len(metadata.get("tokenizer.ggml.tokens", [])) or None)
    if vocab is None:
        raise ModelLoadError("GGUF metadata gives no vocab size (no vocab_size, no tokenizer.ggml.tokens)")
    head_dim = num("attention.key_length", hidden // n_heads)  # Gemma 4: its full layers' (gguf_moe)
    for key in ("attention.value_length", "rope.dimension_count"):
        if m(key) is not None and num(key) != head_dim:
            raise ModelLoadError(f"GGUF metadata has {arch}.{key}={m(key)} for head_dim {head_dim}; sparrow "
                                 "needs them equal")
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": meta.uniform("feed_forward_length") if m("feed_forward_length") else 0,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_heads if arch == "gemma4" else meta.uniform("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", 1e-6, float),
        "max_position_embeddings": num("context_length", 4096),
        "vocab_size": int(vocab),
        "rope_theta": num("rope.freq_base", 10000.0, float),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "gelu_pytorch_tanh" if arch in ("gemma3", "gemma4") else "silu",
        "attention_bias": arch in ("qwen2", "qwen2moe"),
    }


def _add_sliding_window(meta: _Metadata, cfg: dict[str, Any]) -> None:
    """Gemma 3's sliding layers (window required, every 6th layer full, local rope base) and attention scale;
    Mistral's window on every layer when the metadata gives one."""
    if meta.arch == "gemma3":
        if meta.get("attention.sliding_window") is None:
            raise ModelLoadError("GGUF metadata lacks gemma3.attention.sliding_window (Gemma 3's window differs "
                                 "by size)")
        hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        cfg.update(
            query_pre_attn_scalar=(hidden // n_heads if cfg["num_hidden_layers"] == GEMMA3_27B_BLOCKS
                                   else cfg["head_dim"]),
            sliding_window=meta.num("attention.sliding_window"),
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
        )
    elif meta.arch == "mistral" and meta.get("attention.sliding_window") is not None:
        cfg["sliding_window"] = meta.num("attention.sliding_window")
