"""GGUF tensor names and layouts -> HF checkpoint names and layouts: the rules, as functions of (GGUF name,
torch shape), that ``GGUFCheckpoint.tensors`` applies to every tensor it reads.

A rule never looks at the data's values or dtype except where it says so, so the same rule serves a tensor
dequantized to float and one kept as packed rows of GGUF blocks (rows along dim 0, the expert along dim 0 of
a 3-D tensor, the last dim untouched):
- names: gguf-py's ``TENSOR_NAMES`` (``blk.N.attn_q.weight``) -> HF's (``model.layers.N.self_attn.q_proj.weight``);
  shapes are already torch order (the reversed GGUF ne: ne0 = columns last);
- routed experts: llama.cpp stores each layer's experts merged, ``blk.N.ffn_{gate,up,down}_exps.weight``
  ne = [cols, rows, E] (torch [E, rows, cols]; convert_hf_to_gguf.py ``Qwen2MoeModel`` / ``LlamaModel`` stack
  the per-expert HF tensors), or Gemma 4's fused ``ffn_gate_up_exps`` [E, 2I, H] (gate rows first, HF's
  ``experts.gate_up_proj`` as is). Each expert's slice is yielded under its per-expert HF name
  (``...experts.N.gate_proj.weight``), a view of the GGUF tensor that the stacked expert parameter's loader
  copies into place (``sparrow.quant.weight_loaders.expert_loader``): no second stacked copy is built;
- routers: ``ffn_gate_inp`` [E, H] is HF's ``mlp.gate`` (Gemma 4: ``router.proj``); Gemma 4's
  ``ffn_gate_inp.scale`` [H] and ``ffn_down_exps.scale`` [E] are ``router.scale`` / ``router.per_expert_scale``
  (convert_hf_to_gguf.py ``Gemma4Model.modify_tensors``), ``layer_output_scale`` [1] is ``layer_scalar``;
- Qwen2-MoE's shared expert: ``ffn_{gate,up,down}_shexp`` and its sigmoid gate ``ffn_gate_inp_shexp``, which
  the converter squeezes to [H] (HF ``shared_expert_gate.weight`` [1, H]: viewed back as one row);
- Llama-family Q/K rows (llama, mistral, and Mixtral, which GGUF calls llama): llama.cpp's interleaved RoPE
  layout (convert_hf_to_gguf.py ``LlamaModel.permute``: rows reshaped (heads, 2, D/2) and swapped to
  (heads, D/2, 2)); the inverse row permutation gives HF's rotate-half layout;
- Gemma 2/3 norms are stored as 1 + w (convert_hf_to_gguf.py ``Gemma3Model.norm_shift``); 1 is subtracted,
  which only a float tensor allows. Gemma 4 norms are stored as w (``Gemma4Model.norm_shift`` is 0);
- ``rope_freqs``: Llama 3's frequency divisors go to the model (``set_freq_factors``); Gemma 4's (1 on the
  rotated pairs, 1e30 on the rest, for its full layers' proportional RoPE) were read into the config
  (``sparrow.config.gguf``) and are not yielded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from sparrow.errors import ModelLoadError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GEMMA4_NAMES = {  # Gemma 4's router and layer scalar sit on the layer, not under mlp.
    ("ffn_gate_inp", "weight"): "router.proj.weight",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("layer_output_scale", "weight"): "layer_scalar",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_EXPERTS = {  # merged expert tensor -> the per-expert HF projections its rows hold, in order
    "ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",), "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias|scale)$")
_PERMUTED_QK = ("llama", "mistral")
_SHIFTED_NORMS = ("gemma3",)


@dataclass(frozen=True)
class Piece:
    """One HF checkpoint tensor cut from a GGUF tensor (torch order): ``t[expert]`` when ``expert`` is set,
    then rows ``rows[0]:rows[1]`` when set, then viewed as ``(*lead, t.shape[-1])`` when ``lead`` is set."""

    name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    lead: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Rule:
    """How one GGUF tensor becomes HF tensors: ``qk_heads`` (un-permute llama.cpp's Q/K rows, in groups of
    this many heads) and ``norm_shift`` (subtract it; float tensors only) apply to the whole tensor first,
    then each piece is cut. No pieces: the tensor is not yielded (read into the config)."""

    pieces: tuple[Piece, ...]
    qk_heads: int | None = None
    norm_shift: float = 0.0


@dataclass(frozen=True)
class GGUFNames:
    """What the rules need from a file's metadata: architecture, head counts (Q/K permutation), expert count."""

    arch: str
    n_head: int | None = None
    n_kv: int | None = None
    n_experts: int = 0

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> "GGUFNames":
        arch = metadata.get("general.architecture")
        n_head = metadata.get(f"{arch}.attention.head_count")
        n_kv = metadata.get(f"{arch}.attention.head_count_kv", n_head)
        return cls(arch, n_head, n_kv, int(metadata.get(f"{arch}.expert_count") or 0))


def rename(arch: str, gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor that maps one to one (not a merged expert tensor), or None when it has no
    HF counterpart (``rope_freqs``, an unknown name)."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _BLK.match(gguf_name)
    if not m:
        return None
    layer, short, kind = m.groups()
    if arch == "gemma4" and (short, kind) in _GEMMA4_NAMES:
        return f"model.layers.{layer}.{_GEMMA4_NAMES[short, kind]}"
    if kind == "scale":
        return None
    if short == "ffn_norm":
        # Gemma 3/4 have sandwich norms: their ffn_norm is the pre-FF norm; elsewhere the post-attention norm
        hf = "pre_feedforward_layernorm" if arch in ("gemma3", "gemma4") else "post_attention_layernorm"
    elif short in _LAYER_NAMES:
        hf = _LAYER_NAMES[short]
    else:
        return None
    return f"model.layers.{layer}.{hf}.{kind}"


def tensor_rule(names: GGUFNames, gguf_name: str, shape: tuple[int, ...]) -> Rule:
    """The rule for GGUF tensor ``gguf_name`` of torch shape ``shape`` in a file of ``names``' architecture.

    Raises ModelLoadError naming the tensor for a name sparrow does not know for the architecture, and for an
    expert tensor or router whose expert count (dim 0) is not ``{arch}.expert_count``, or a fused gate/up
    tensor with an odd row count."""
    arch = names.arch
    if gguf_name == "rope_freqs.weight":
        return Rule(() if arch == "gemma4" else (Piece("rope_freqs"),))
    m = _BLK.match(gguf_name)
    if m and m.group(2) in _EXPERTS and m.group(3) == "weight":
        return _expert_rule(names, gguf_name, shape, int(m.group(1)), m.group(2))
    name = rename(arch, gguf_name)
    if name is None:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known HF counterpart for {arch}")
    if (m and m.group(2) == "ffn_gate_inp" and m.group(3) == "weight") or gguf_name.endswith("ffn_down_exps.scale"):
        _check_experts(names, gguf_name, shape)  # the router's rows / Gemma 4's per-expert scales
    if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
        return Rule((Piece(name, lead=(1,)),))  # squeezed to [H] by the converter; HF's is [1, H]
    heads = None
    if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = names.n_head if "q_proj" in name else names.n_kv
    shift = 1.0 if arch in _SHIFTED_NORMS and name.endswith("norm.weight") else 0.0
    return Rule((Piece(name),), qk_heads=heads, norm_shift=shift)


def _check_experts(names: GGUFNames, gguf_name: str, shape: tuple[int, ...]) -> None:
    if not shape or shape[0] != names.n_experts:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} of shape {shape} holds {shape[0] if shape else 0} experts, "
                             f"but the metadata's {names.arch}.expert_count is {names.n_experts}")


def _expert_rule(names: GGUFNames, gguf_name: str, shape: tuple[int, ...], layer: int, short: str) -> Rule:
    """One piece per (expert, projection) of a merged expert tensor [E, rows, cols]."""
    if len(shape) != 3:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has shape {shape}; merged experts are 3-D "
                             "[experts, rows, cols] (ne = [cols, rows, experts])")
    _check_experts(names, gguf_name, shape)
    parts = _EXPERTS[short]
    if shape[1] % len(parts):
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} of shape {shape} has an odd row count; it must hold the "
                             "gate rows, then as many up rows")
    rows = shape[1] // len(parts)
    base = f"model.layers.{layer}.{'experts' if names.arch == 'gemma4' else 'mlp.experts'}"
    return Rule(tuple(Piece(f"{base}.{e}.{part}.weight", expert=e, rows=(i * rows, (i + 1) * rows))
                      for e in range(shape[0]) for i, part in enumerate(parts)))


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a Q or K projection from llama.cpp's interleaved one: rows [heads * D, ...]
    viewed (heads, D/2, 2) -> (heads, 2, D/2), the inverse of convert_hf_to_gguf.py's ``LlamaModel.permute``. A
    row permutation: dims after the first (columns, or a packed row's bytes) are untouched."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def apply_rule(rule: Rule, gguf_name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for GGUF tensor ``gguf_name`` holding ``t`` (torch order: float values, or packed
    rows) by ``rule``; pieces are views of ``t`` (after the whole-tensor steps). Raises ModelLoadError when a
    norm shift meets a tensor that is not float."""
    if rule.qk_heads:
        t = unpermute_qk(t, rule.qk_heads)
    if rule.norm_shift:
        if not t.is_floating_point():
            raise ModelLoadError(f"GGUF tensor {gguf_name!r} is stored quantized; sparrow reads this norm (stored "
                                 f"as {rule.norm_shift:g} + w) only from a float tensor (F32, F16, BF16)")
        t = t - rule.norm_shift
    for p in rule.pieces:
        w = t if p.expert is None else t[p.expert]
        if p.rows is not None:
            w = w[p.rows[0]:p.rows[1]]
        if p.lead is not None:
            w = w.reshape(*p.lead, w.shape[-1])
        yield p.name, w
