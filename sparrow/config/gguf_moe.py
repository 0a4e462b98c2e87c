"""GGUF metadata -> the HF config fields of MoE files (qwen2moe, qwen3moe, gemma4, and llama with
``llama.expert_count`` > 0, which is Mixtral) and of Gemma 4; the rest of the mapping is
``sparrow.config.gguf.hf_config_from_gguf``'s. Keys are gguf-py's (``gguf.constants.Keys``): expert_count,
expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length, expert_weights_norm,
expert_gating_func, expert_weights_scale, attention.sliding_window_pattern, attention.key_length_swa, ...;
tensor names are gguf-py's ``TENSOR_NAMES`` (``blk.N.ffn_gate_inp.weight``). The writer is llama.cpp's
convert_hf_to_gguf.py (``Qwen2MoeModel``, ``Qwen3MoeModel``, ``LlamaModel``, ``Gemma4Model``), the reference
reader its ``llama_model::load_hparams`` / ``load_tensors``.

MoE rules (``moe_fields``):
- num_experts / num_experts_per_tok (top-k): expert_count / expert_used_count, required; top-k <= experts.
- expert width: expert_feed_forward_length (Mixtral: feed_forward_length, the converter's intermediate_size,
  when the key is absent); the dense width (qwen's dense layers, Gemma 4's dense MLP): feed_forward_length.
- which layers have experts: those with a router tensor ``blk.N.ffn_gate_inp.weight`` (every layer when no
  tensor names are given, llama.cpp's assumption). Qwen's other layers are dense (HF mlp_only_layers);
  Mixtral and Gemma 4 put experts on every layer, so a file with routers on some layers only is refused.
- each expert layer must hold its routed experts (ffn_gate_exps + ffn_up_exps, or the fused
  ffn_gate_up_exps, and ffn_down_exps), Qwen2-MoE's shared expert (ffn_{gate,up,down}_shexp and its gate
  ffn_gate_inp_shexp) when expert_shared_feed_forward_length is set, and Gemma 4's router scales and
  norms; a missing one is refused by its GGUF name.
- routing: softmax (expert_gating_func, when present, must be 1 = softmax); the top-k weights renormalized
  for qwen3moe, Mixtral and Gemma 4 (llama.cpp's loaders hard-wire it; HF Qwen3-MoE's norm_topk_prob), not
  for qwen2moe (HF Qwen2-MoE's norm_topk_prob false); expert_weights_norm, when present, overrides it for
  qwen, and must agree for Mixtral and Gemma 4 (which always renormalize); expert_weights_scale, when
  present, must be 1.
- Qwen2-MoE's shared expert (sigmoid-gated): expert_shared_feed_forward_length; its tensors without the key
  are refused (the width is not in the metadata).

Gemma 4 rules (``gemma4_fields``; HF Gemma4TextConfig field names, the per-layer shapes as transformers 5's
``per_layer_config``):
- layer types: attention.sliding_window_pattern (one bool per layer, true = sliding; required), window
  attention.sliding_window (required).
- sliding layers: head dim attention.key_length_swa, KV heads head_count_kv at those layers, RoPE base
  rope.freq_base_swa (default 10000, HF's), rope.dimension_count_swa must equal the head dim.
- full layers: head dim attention.key_length, KV heads head_count_kv at those layers, RoPE base
  rope.freq_base, "proportional" RoPE whose partial_rotary_factor is read from ``rope_freqs`` (the
  converter writes 1 for each rotated frequency pair, then 1e30: factor = 2 x (number of 1s) / head dim);
  the tensor is required. attention_k_eq_v when no full layer has ``attn_v`` (the converter writes none for
  k_eq_v checkpoints); some full layers with and some without, or a sliding layer without, is refused.
- final_logit_softcapping: the key of that name; hidden_activation gelu_pytorch_tanh; norms stored as w.
- per-layer input embeddings (embedding_length_per_layer_input) and KV sharing (attention.shared_kv_layers)
  are passed on as HF's fields, which ``ModelConfig.from_hf`` refuses when non-zero.
"""
from __future__ import annotations

from typing import Any

from sparrow.errors import ModelLoadError

_SOFTMAX = 1
"""gguf-py ``ExpertGatingFuncType.SOFTMAX``."""
_ROPE_OFF = 1e20
"""A rope_freqs divisor at least this large switches its frequency pair off (the converter writes 1e30)."""
_WHAT = {  # GGUF tensor of an expert layer -> what it is, for the missing-tensor message
    "ffn_gate_exps.weight": "routed experts' gate projections", "ffn_up_exps.weight": "routed experts' up projections",
    "ffn_down_exps.weight": "routed experts' down projections",
    "ffn_gate_shexp.weight": "shared expert's gate projection", "ffn_up_shexp.weight": "shared expert's up projection",
    "ffn_down_shexp.weight": "shared expert's down projection", "ffn_gate_inp_shexp.weight": "shared expert's gate",
    "ffn_gate_inp.scale": "router scale", "ffn_down_exps.scale": "per-expert scales",
    "pre_ffw_norm_2.weight": "experts' input norm", "post_ffw_norm_1.weight": "dense branch's output norm",
    "post_ffw_norm_2.weight": "experts' output norm",
}


def moe_fields(meta, cfg: dict[str, Any], names: set[str] | None) -> dict[str, Any]:
    """The HF MoE fields of a GGUF file (the module's MoE rules; empty for a dense file). ``meta``: the
    file's ``sparrow.config.gguf._Metadata``; ``cfg``: the HF fields read so far; ``names``: the file's
    tensor names or None. Raises ModelLoadError naming the key or tensor."""
    arch, n_layers = meta.arch, cfg["num_hidden_layers"]
    if arch not in ("qwen2moe", "qwen3moe") and not (arch in ("llama", "gemma4") and meta.get("expert_count")):
        return {}
    experts, top_k = meta.num("expert_count"), meta.num("expert_used_count")
    if top_k > experts:
        raise ModelLoadError(f"GGUF metadata has {arch}.expert_used_count={top_k} for {arch}.expert_count="
                             f"{experts}; top-k must be at most the expert count")
    width = meta.num("expert_feed_forward_length", cfg["intermediate_size"] if arch == "llama" else None)
    norm = _renormalize(meta)
    moe = [i for i in range(n_layers) if names is None or f"blk.{i}.ffn_gate_inp.weight" in names]
    dense = [i for i in range(n_layers) if i not in moe]
    if not moe or (dense and arch in ("llama", "gemma4")):
        raise ModelLoadError(f"GGUF {arch} file has routers (blk.N.ffn_gate_inp.weight) on layers {moe} but not on "
                             f"{dense}; sparrow builds {'Mixtral' if arch == 'llama' else arch} with experts on "
                             f"{'some layer' if not moe else 'every layer'}")
    shared = _shared_width(meta, names)
    if names is not None:
        _check_expert_tensors(arch, moe, names, shared)
    if arch == "llama":
        return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                    num_experts_per_tok=top_k, intermediate_size=width)
    if arch == "gemma4":
        return dict(enable_moe_block=True, num_experts=experts, top_k_experts=top_k, moe_intermediate_size=width)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width, norm_topk_prob=norm,
                mlp_only_layers=dense, decoder_sparse_step=1, shared_expert_intermediate_size=shared)


def _renormalize(meta) -> bool:
    """Whether the top-k router weights are renormalized (the routing rules); refuses a gating function or
    weight scale sparrow's router for the architecture does not have."""
    arch = meta.arch
    gating, scale, norm = (meta.get(k) for k in ("expert_gating_func", "expert_weights_scale", "expert_weights_norm"))
    if gating not in (None, _SOFTMAX):
        raise ModelLoadError(f"GGUF metadata has {arch}.expert_gating_func={gating!r}; sparrow's {arch} router "
                             f"is softmax ({_SOFTMAX})")
    if scale not in (None, 1, 1.0):
        raise ModelLoadError(f"GGUF metadata has {arch}.expert_weights_scale={scale!r}; sparrow's {arch} router "
                             "has no expert weight scale (1)")
    default = arch != "qwen2moe"
    if norm is not None and bool(norm) != default and arch in ("llama", "gemma4"):
        raise ModelLoadError(f"GGUF metadata has {arch}.expert_weights_norm={norm!r}; {arch} always renormalizes "
                             "its top-k weights")
    return default if norm is None else bool(norm)


def _shared_width(meta, names: set[str] | None) -> int:
    """Qwen2-MoE's shared expert width (0: none); ModelLoadError for shared-expert tensors without the key."""
    if meta.get("expert_shared_feed_forward_length") is not None:
        return meta.num("expert_shared_feed_forward_length")
    has = sorted(n for n in names or () if "_shexp." in n)
    if has:
        raise ModelLoadError(f"GGUF file has shared-expert tensors ({has[0]}, ...) but its metadata lacks "
                             f"{meta.arch}.expert_shared_feed_forward_length (their width)")
    return 0


def _check_expert_tensors(arch: str, moe: list[int], names: set[str], shared: int) -> None:
    """Every expert layer holds its expert tensors (the MoE rules); ModelLoadError naming the first missing."""
    need = ["ffn_down_exps.weight"]
    if shared:
        need += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"]
    if arch == "gemma4":
        need += ["ffn_gate_inp.scale", "ffn_down_exps.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
                 "post_ffw_norm_2.weight"]
    for i in moe:
        blk = f"blk.{i}."
        missing = [n for n in need if blk + n not in names]
        if blk + "ffn_gate_up_exps.weight" not in names:
            missing = [n for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight") if blk + n not in names] + missing
        if missing:
            fused = " (or the fused blk.{i}.ffn_gate_up_exps.weight)" if missing[0] in (
                "ffn_gate_exps.weight", "ffn_up_exps.weight") else ""
            raise ModelLoadError(f"GGUF file lacks {blk + missing[0]!r}{fused.format(i=i)}, the {_WHAT[missing[0]]} "
                                 f"of layer {i}, which has a router ({blk}ffn_gate_inp.weight)")


def gemma4_fields(meta, cfg: dict[str, Any], names: set[str] | None, rope_freqs: list[float] | None) -> dict:
    """The HF fields of a Gemma 4 GGUF file that the shared rules do not give (the module's Gemma 4 rules).
    Raises ModelLoadError naming the key or tensor."""
    n_layers, full_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    pattern = meta.layer_values("attention.sliding_window_pattern")
    if any(not isinstance(s, bool) for s in pattern):
        raise ModelLoadError(f"GGUF metadata has gemma4.attention.sliding_window_pattern={pattern!r}; it must be "
                             "one bool per layer (true = sliding)")
    types = ["sliding_attention" if s else "full_attention" for s in pattern]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    kv = meta.layer_values("attention.head_count_kv", cfg["num_attention_heads"])
    kv_of = {t: {kv[i] for i in range(n_layers) if types[i] == t} for t in set(types)}
    if any(len(v) > 1 for v in kv_of.values()):
        raise ModelLoadError(f"GGUF metadata has gemma4.attention.head_count_kv={kv}; sparrow needs one KV head "
                             "count per layer type")
    swa_dim = meta.num("attention.key_length_swa")
    for key in ("attention.value_length_swa", "rope.dimension_count_swa"):
        if meta.get(key) is not None and meta.num(key) != swa_dim:
            raise ModelLoadError(f"GGUF metadata has gemma4.{key}={meta.get(key)} for key_length_swa {swa_dim}; "
                                 "sparrow needs them equal")
    rope_full = {"rope_type": "proportional", "partial_rotary_factor": _partial_rotary(rope_freqs, full_dim, full),
                 "rope_theta": meta.num("rope.freq_base", 10000.0, float)}
    out = dict(
        head_dim=swa_dim, layer_types=types, sliding_window=meta.num("attention.sliding_window"),
        num_key_value_heads=meta.num("attention.head_count_kv", value=next(iter(kv_of.get("sliding_attention", kv)))),
        per_layer_config={str(i): {"head_dim": full_dim, "num_key_value_heads": kv[i]} for i in full},
        rope_parameters={"sliding_attention": {"rope_type": "default",
                                               "rope_theta": meta.num("rope.freq_base_swa", 10000.0, float)},
                         "full_attention": rope_full},
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=meta.get("final_logit_softcapping"),
        hidden_size_per_layer_input=meta.get("embedding_length_per_layer_input") or 0,
        num_kv_shared_layers=meta.get("attention.shared_kv_layers") or 0,
    )
    if names is not None:
        out["attention_k_eq_v"] = _k_eq_v(types, names)
    return out


def _k_eq_v(types: list[str], names: set[str]) -> bool:
    """Gemma 4's attention_k_eq_v: no full layer has attn_v (the Gemma 4 rules); ModelLoadError otherwise."""
    has_v = {i: f"blk.{i}.attn_v.weight" in names for i in range(len(types))}
    if not all(has_v[i] for i, t in enumerate(types) if t == "sliding_attention"):
        layer = next(i for i, t in enumerate(types) if t == "sliding_attention" and not has_v[i])
        raise ModelLoadError(f"GGUF file lacks 'blk.{layer}.attn_v.weight', the V projection of sliding layer {layer}")
    full = {has_v[i] for i, t in enumerate(types) if t == "full_attention"}
    if len(full) > 1:
        raise ModelLoadError("GGUF gemma4 file has attn_v on some full-attention layers and not on others; sparrow "
                             "needs all (separate V) or none (attention_k_eq_v)")
    return full == {False}


def _partial_rotary(rope_freqs: list[float] | None, head_dim: int, full: list[int]) -> float:
    """Gemma 4's full-layer partial_rotary_factor from the rope_freqs values (the Gemma 4 rules)."""
    if not full:
        return 1.0
    if rope_freqs is None:
        raise ModelLoadError("GGUF gemma4 file lacks 'rope_freqs.weight', the frequency factors of its full-attention "
                             "layers' proportional RoPE")
    rotated = next((i for i, f in enumerate(rope_freqs) if f != 1.0), len(rope_freqs))
    if len(rope_freqs) != head_dim // 2 or any(f < _ROPE_OFF for f in rope_freqs[rotated:]):
        raise ModelLoadError(f"GGUF gemma4 tensor 'rope_freqs.weight' ({len(rope_freqs)} values) is not proportional "
                             f"RoPE for head dim {head_dim}: {head_dim // 2} values, 1 for each rotated pair, then "
                             f">= {_ROPE_OFF:g}")
    factor = 2 * rotated / head_dim
    if int(factor * head_dim // 2) != rotated:
        raise ModelLoadError(f"GGUF gemma4 rope_freqs rotate {rotated} of {head_dim // 2} pairs, which no "
                             "partial_rotary_factor gives exactly")
    return factor
