"""Readers of architecture-specific HF ``config.json`` fields for ``ModelConfig.from_hf``: Gemma 4's per-layer
shapes and the Gemma 4 features sparrow refuses, and the MoE fields of every routed family (plain values, so
this module needs nothing from sparrow.config)."""
from __future__ import annotations

from sparrow.errors import ModelLoadError


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
