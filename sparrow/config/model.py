"""``ModelConfig``: a decoder model's shape and numerics, normalized once.

``ModelConfig.from_hf`` turns an HF ``config.json`` dict (any supported architecture, transformers 4 or 5
field names) into explicit fields (its field checks and family readers: ``config.hf_fields``); ``from_gguf``
first maps GGUF metadata onto HF names (``config.gguf.hf_config_from_gguf``), then calls it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparrow.config.architectures import resolve_architecture
from sparrow.config.gguf import hf_config_from_gguf
from sparrow.config.hf_fields import check_fields, check_gemma4, gemma4_layer_shape, moe_fields
from sparrow.errors import ModelLoadError
from sparrow.kernels.activation.act import ACTIVATIONS


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
        the wrong type or out of range names ``source`` and the field: ``config.hf_fields.check_fields``)."""
        cfg = _decoder_fields(cfg, source)
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
        layers = _layer_specs(cfg, model_type, _layer_types(cfg, model_type, n_layers), n_kv, head_dim)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        scalar = cfg.get("query_pre_attn_scalar")
        act = _activation(cfg)
        positions = _max_positions(cfg)
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
    def from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str] | None = None,
                  rope_freqs: list[float] | None = None) -> "ModelConfig":
        """Normalize GGUF metadata (with the file's tensor names and ``rope_freqs.weight`` values):
        ``config.gguf.hf_config_from_gguf`` (its docstring lists the rule for each field the metadata lacks),
        then ``from_hf``. Raises UnsupportedArchitectureError / ModelLoadError."""
        return cls.from_hf(hf_config_from_gguf(metadata, tensor_names, rope_freqs),
                           source="the GGUF metadata (as HF fields)")


def _decoder_fields(cfg: dict, source: str) -> dict:
    """A copy of the config's decoder fields, checked (``check_fields``): the config itself, or the
    ``text_config`` of a multimodal one (which inherits its ``architectures`` and is marked ``_multimodal``)."""
    check_fields(cfg, source)
    cfg = dict(cfg)
    if "text_config" in cfg and isinstance(cfg["text_config"], dict) and "hidden_size" not in cfg:
        text = dict(cfg["text_config"])
        text.setdefault("architectures", cfg.get("architectures"))
        text["_multimodal"] = True
        check_fields(text, f"{source} text_config")
        cfg = text
    return cfg


def _layer_types(cfg: dict, model_type: str, n_layers: int) -> list[str]:
    """Each layer's 'sliding_attention' / 'full_attention': ``layer_types``, else the family's rule (Gemma 3's
    pattern, Mistral / Mixtral's window on every layer); Qwen's windows only with ``use_sliding_window``.
    ModelLoadError when ``layer_types`` does not give one entry per layer."""
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
    return layer_types


def _layer_specs(cfg: dict, model_type: str, layer_types: list[str], n_kv: int,
                 head_dim: int) -> tuple[LayerSpec, ...]:
    """Each layer's LayerSpec (Gemma 4's per-layer KV heads and head dim, checked first: ``check_gemma4``)."""
    window = cfg.get("sliding_window")
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
    return tuple(layers)


def _activation(cfg: dict) -> str:
    """The MLP activation's HF name (``hidden_activation``, ``hidden_act``, default 'silu'); ModelLoadError for
    one sparrow has no kernel for (``kernels.activation.act.ACTIVATIONS``)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ModelLoadError(f"config.json has hidden_act={act!r}; sparrow supports {sorted(ACTIVATIONS)}")
    return act


def _max_positions(cfg: dict) -> int | None:
    """``max_position_embeddings`` (a whole float such as 2048.0 taken as an int), None when absent;
    ModelLoadError for anything but an integer >= 2."""
    positions = cfg.get("max_position_embeddings")
    if isinstance(positions, float) and positions.is_integer():
        positions = int(positions)  # 2048.0: accepted as before
    if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 2):
        raise ModelLoadError(f"config.json has max_position_embeddings={positions!r}; it must be an integer >= 2")
    return positions
