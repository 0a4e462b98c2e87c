"""Write a tiny transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does (gguf-py's
tensor names and metadata keys, merged 3-D expert tensors, Llama's Q/K row permutation, Qwen2-MoE's squeezed
shared-expert gate, Gemma 4's relocated router scales and rope_freqs), with every 2-D / 3-D weight replaced
by random valid quantized blocks, and make the oracle: the same transformers model whose weights are gguf-py's
dequantization (``gguf.quants.dequantize``) of exactly those blocks, mapped back to HF names and layout.

Block types: a mix of Q4_K / Q6_K / Q8_0 where a row's length is a multiple of 256, Q8_0 / Q5_0 where only of
32; routers, norms, biases and scales stay F32 (as llama.cpp's quantizer leaves them). Random blocks are random
bytes whose fp16 scale fields (ggml-common.h offsets, ``FP16_FIELDS``) are finite and sized so weights stay
within about +-0.1. Used by tests/loader/test_gguf_moe_files.py; any family of tests/models/_hf_tiny.py whose
GGUF architecture is in ``GGUF_ARCH`` can be written.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf import quants as gq

from tests.kernels.common.test_gguf_blocks import FP16_FIELDS

GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "qwen2_moe": "qwen2moe", "gemma4": "gemma4"}
"""HF family (tests/models/_hf_tiny.py) -> the GGUF architecture convert_hf_to_gguf.py writes for it."""
_AMPLITUDE = {T.Q4_K: 1e-4, T.Q6_K: 2.5e-5, T.Q8_0: 8e-4, T.Q5_0: 6e-3}
"""Largest |fp16 scale field| per type: d x (largest quant x sub-block scale) stays near 0.1."""
_K_TYPES, _SMALL_TYPES = (T.Q4_K, T.Q6_K, T.Q8_0), (T.Q8_0, T.Q5_0)
_FLOAT_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # routers stay F32

_LAYER = {  # HF module under model.layers.N. -> GGUF short name
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "post_feedforward_layernorm": "post_ffw_norm",
    "pre_feedforward_layernorm": "ffn_norm", "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1", "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "router.proj": "ffn_gate_inp",
}
_GEMMA4_LEAVES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
                  "layer_scalar": "layer_output_scale.weight"}


def random_blocks(qtype: T, rows_shape: tuple[int, ...], cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks for a tensor of torch shape (*rows_shape, cols): uint8 (*rows_shape, bytes per row)."""
    block, size = gq.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(rows_shape)) * cols // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        a = _AMPLITUDE[qtype]
        blocks[:, off:off + 2] = rng.uniform(-a, a, size=(n, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(*rows_shape, cols // block * size)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp's interleaved rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _names(family: str, hf_name: str) -> list[str]:
    """The GGUF tensors convert_hf_to_gguf.py writes for HF tensor ``hf_name`` (two for a fused gate/up)."""
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return [globals_[hf_name]]
    rest = hf_name.split(".", 3)[3]
    blk = f"blk.{hf_name.split('.')[2]}."
    if rest in _GEMMA4_LEAVES:
        return [blk + _GEMMA4_LEAVES[rest]]
    if rest.endswith("experts.gate_up_proj"):
        fused = family == "gemma4"
        return [blk + "ffn_gate_up_exps.weight"] if fused else [blk + "ffn_gate_exps.weight", blk + "ffn_up_exps.weight"]
    if rest.endswith("experts.down_proj"):
        return [blk + "ffn_down_exps.weight"]
    module, _, leaf = rest.rpartition(".")
    if module == "post_attention_layernorm":
        return [blk + ("post_attention_norm" if family == "gemma4" else "ffn_norm") + "." + leaf]
    return [blk + _LAYER[module] + "." + leaf]


def _to_gguf(family: str, cfg, hf_name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    names = _names(family, hf_name)
    if len(names) == 2:  # HF 5's fused experts.gate_up_proj [E, 2I, H] -> gate [E, I, H], up [E, I, H]
        return list(zip(names, t.chunk(2, dim=1)))
    if GGUF_ARCH[family] == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        t = _permute(t, cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads)
    return [(names[0], t.squeeze() if t.dim() > 1 else t)]  # the converter squeezes (shared_expert_gate -> [H])


def _to_hf(family: str, cfg, hf_name: str, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    t = torch.cat(parts, dim=1) if len(parts) == 2 else parts[0]
    if GGUF_ARCH[family] == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        t = _unpermute(t, cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads)
    return t.reshape(like.shape)


def _quantize(name: str, t: torch.Tensor, index: int, rng) -> tuple[np.ndarray, T | None, torch.Tensor]:
    """(data to write, its block type or None for F32, the float values it holds)."""
    if t.dim() < 2 or name.endswith(_FLOAT_SUFFIXES):
        arr = t.float().contiguous().numpy()
        return arr, None, torch.from_numpy(arr.copy())
    cols = t.shape[-1]
    kinds = _K_TYPES if cols % 256 == 0 else _SMALL_TYPES
    qtype = kinds[index % len(kinds)]
    blocks = random_blocks(qtype, tuple(t.shape[:-1]), cols, rng)
    values = gq.dequantize(blocks, qtype).astype(np.float32).reshape(t.shape)
    return blocks, qtype, torch.from_numpy(values)


def _metadata(w: GGUFWriter, family: str, cfg, drop: tuple[str, ...]) -> None:
    """What convert_hf_to_gguf.py's set_gguf_parameters writes for this family (gguf-py key names)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if family == "gemma4":
        return _gemma4_metadata(w, cfg, rope, "rope_freqs.weight" not in drop)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _gemma4_metadata(w: GGUFWriter, cfg, rope: dict, rope_freqs: bool) -> None:
    """Gemma4Model.set_gguf_parameters: per-type head dims, KV heads and RoPE, the sliding pattern, and the
    rope_freqs tensor of generate_extra_tensors. Per-layer values come from transformers 5's per_layer_config."""
    d = cfg.to_dict()
    swa = [t == "sliding_attention" for t in d["layer_types"]]
    per_layer = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    kv = [per_layer.get(i, {}).get("num_key_value_heads", d["num_key_value_heads"]) for i in range(len(swa))]
    full_dim = next(per_layer.get(i, {}).get("head_dim", d["head_dim"]) for i, s in enumerate(swa) if not s)
    w.add_head_count_kv(kv)
    w.add_sliding_window_pattern(swa)
    w.add_sliding_window(d["sliding_window"])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(d["head_dim"])
    w.add_value_length_swa(d["head_dim"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(d["head_dim"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_final_logit_softcapping(d["final_logit_softcapping"])
    w.add_shared_kv_layers(d.get("num_kv_shared_layers") or 0)
    w.add_embedding_length_per_layer_input(d.get("hidden_size_per_layer_input") or 0)
    w.add_expert_count(d["num_experts"])
    w.add_expert_used_count(d["top_k_experts"])
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    if not rope_freqs:
        return
    rotated = int(full_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), np.float32))


def write_gguf(model: torch.nn.Module, family: str, path: Path, seed: int = 0, drop: tuple[str, ...] = (),
               metadata: dict | None = None, arch: str | None = None) -> torch.nn.Module:
    """Write ``model`` (transformers, fp32, of tests/models/_hf_tiny.py family ``family``) to ``path`` as GGUF
    with random quantized blocks, and load the dequantized blocks back into ``model`` (returned: the oracle).
    ``drop``: GGUF tensor names left out; ``metadata``: extra {key: value} written after the converter's
    (int, float, bool or str); ``arch``: another general.architecture (for error tests)."""
    cfg, rng = model.config, np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch or GGUF_ARCH[family])
    _metadata(w, family, cfg, drop)
    for key, value in (metadata or {}).items():
        {int: w.add_uint32, float: w.add_float32, bool: w.add_bool, str: w.add_string}[type(value)](key, value)
    state = model.state_dict()
    tied = cfg.tie_word_embeddings or getattr(cfg.get_text_config(), "tie_word_embeddings", False)
    loaded: dict[str, torch.Tensor] = {}
    for index, (hf_name, t) in enumerate(state.items()):
        if (hf_name == "lm_head.weight" and tied) or "rotary_emb" in hf_name:
            continue
        parts = []
        for name, g in _to_gguf(family, cfg, hf_name, t.detach()):
            data, qtype, values = _quantize(name, g, index, rng)
            if name not in drop:
                w.add_tensor(name, data, raw_dtype=qtype)
            parts.append(values)
        loaded[hf_name] = _to_hf(family, cfg, hf_name, parts, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        for hf_name, t in loaded.items():
            state[hf_name].copy_(t)
    return model
