"""Readers of architecture-specific HF ``config.json`` fields for ``ModelConfig.from_hf``: the type and range
check of every field it reads, Gemma 4's per-layer shapes and the Gemma 4 features sparrow refuses, and the MoE
fields of every routed family (plain values, so this module needs nothing from ``config.model``)."""
from __future__ import annotations

from sparrow.errors import ModelLoadError

_INT_FIELDS = {  # name -> smallest value; checked when present (the required ones: ModelConfig.from_hf)
    "hidden_size": 1, "num_attention_heads": 1, "num_hidden_layers": 1, "vocab_size": 1, "head_dim": 1,
    "num_key_value_heads": 1, "intermediate_size": 0, "sliding_window": 0, "sliding_window_pattern": 1,
    "num_experts": 0, "num_local_experts": 0, "n_routed_experts": 0, "num_experts_per_tok": 0,
    "moe_intermediate_size": 0, "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1,
    "query_pre_attn_scalar": 1, "global_head_dim": 1, "num_global_key_value_heads": 1, "top_k_experts": 0,
}
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "routed_scaling_factor",
                    "attn_logit_softcapping", "final_logit_softcapping")


def _is_int(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def check_fields(cfg, source: str = "config.json") -> None:
    """Type and range of every shape and numeric field ``ModelConfig.from_hf`` reads from an HF config dict,
    before any is used: integers (a whole float such as 64.0 passes) at least their minimum, positive finite
    numbers for epsilons, rope bases, scales and soft-caps (None allowed where HF allows it), strings for
    ``model_type`` / ``hidden_act``, a list of strings for ``architectures``, integers for the token ids.
    Raises ModelLoadError naming ``source``, the field and its value."""
    import math

    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{source} must be a JSON object ({{...}}), got {type(cfg).__name__} "
                             f"{str(cfg)[:40]!r}")
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(f"{source} has architectures={archs!r}; it must be a list of names, e.g. "
                             "[\"LlamaForCausalLM\"]")
    for name in ("model_type", "hidden_act", "hidden_activation"):
        if cfg.get(name) is not None and not isinstance(cfg[name], str):
            raise ModelLoadError(f"{source} has {name}={cfg[name]!r}; it must be a string")
    for name, low in _INT_FIELDS.items():
        v = cfg.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < low:
            raise ModelLoadError(f"{source} has {name}={v!r}; it must be an integer >= {low}")
    floats = [(n, cfg.get(n)) for n in _POSITIVE_FLOATS]
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        subs = [rope] + [v for v in rope.values() if isinstance(v, dict)]
        floats += [("rope_parameters.rope_theta", r.get("rope_theta")) for r in subs]
    elif rope is not None:
        raise ModelLoadError(f"{source} has rope_parameters={rope!r}; it must be an object")
    if cfg.get("rope_scaling") is not None and not isinstance(cfg["rope_scaling"], dict):
        raise ModelLoadError(f"{source} has rope_scaling={cfg['rope_scaling']!r}; it must be an object or null")
    for name, v in floats:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ModelLoadError(f"{source} has {name}={v!r}; it must be a positive number")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(name)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_int(i) and i >= 0 for i in ids):
            raise ModelLoadError(f"{source} has {name}={v!r}; it must be a token id (an integer >= 0) or a list")
    for name in ("layer_types", "mlp_only_layers"):
        v = cfg.get(name)
        if v is not None and not isinstance(v, list):
            raise ModelLoadError(f"{source} has {name}={v!r}; it must be a list")
    if cfg.get("layer_types") and not all(t in ("sliding_attention", "full_attention") for t in cfg["layer_types"]):
        raise ModelLoadError(f"{source} has layer_types entries other than 'sliding_attention' / "
                             f"'full_attention': {sorted(set(map(str, cfg['layer_types'])))}")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and int(heads) % int(kv):
        raise ModelLoadError(f"{source} has num_attention_heads={heads}, not a multiple of "
                             f"num_key_value_heads={kv}")


def check_gemma4(cfg: dict) -> None:
    """Gemma 4 features outside the MoE text decoder (26B-A4B) sparrow runs: an error, never ignored."""
    unsupported = {
        "hidden_size_per_layer_input": "per-layer input embeddings (PLE)",
        "num_kv_shared_layers": "KV sharing across layers",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ModelLoadError(f"Gemma 4 config sets {key}={cfg[key]!r} ({what}), which sparrow does not support")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("Gemma 4 config sets use_bidirectional_attention='all'; sparrow runs causal decoders only")


def gemma4_layer_shape(cfg: dict, i: int, layer_type: str, n_kv: int, head_dim: int) -> tuple[int, int]:
    """(KV heads, head dim) of Gemma 4 layer i: transformers 5's ``per_layer_config`` when saved (layers it does
    not list, or all when it is empty, take the top-level values: transformers >= 5.2x saves only the
    differences there), else the ``global_head_dim`` (default 512) / ``num_global_key_value_heads`` of
    full-attention layers (older configs)."""
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, dict):
        by_index = {int(k): v for k, v in per_layer.items() if str(k).isdigit()}  # keys may be "05"
        over = by_index.get(i) or per_layer.get(layer_type) or {}
        return int(over.get("num_key_value_heads", n_kv)), int(over.get("head_dim", head_dim))
    if layer_type != "full_attention":
        return n_kv, head_dim
    kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", False) else None
    return int(kv or n_kv), int(cfg.get("global_head_dim") or 512)


def moe_fields(cfg: dict, model_type: str) -> dict:
    """The MoE fields of ModelConfig from an HF config (empty for a dense model). Raises ModelLoadError for a
    top-k outside [1, num_experts]."""
    out = _moe_values(cfg, model_type)
    if out:
        k, n = out["num_experts_per_tok"], out["num_experts"]
        if not 1 <= k <= n:
            raise ModelLoadError(f"MoE config has num_experts_per_tok={k} (top-k) for num_experts={n}; "
                                 f"it must be in [1, {n}]")
    return out


def _moe_values(cfg: dict, model_type: str) -> dict:
    if model_type.startswith("gemma4"):
        if not cfg.get("enable_moe_block"):
            return {}
        return dict(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["top_k_experts"]),
                    moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True)
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    if not n:
        return {}
    out = dict(
        num_experts=n,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type in ("mixtral", "minimax_m2"))),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        n_group=cfg.get("n_group"),
        topk_group=cfg.get("topk_group"),
    )
    if model_type == "minimax_m2":
        out.update(router_scoring="sigmoid", router_correction_bias=True, norm_topk_prob=True)
    elif cfg.get("scoring_func"):
        out.update(router_scoring=str(cfg["scoring_func"]),
                   router_correction_bias=cfg.get("topk_method") == "noaux_tc" or model_type == "deepseek_v3")
    return out
