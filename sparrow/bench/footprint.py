"""Bytes one decode step must read (weights touched, experts hit, KV cache), for the % of the bandwidth bound."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch



_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k")


@dataclass
class Footprint:
    """What one decode step must read, apart from activations (bytes)."""

    weight_bytes: dict[str, int]
    """Parameter bytes by group: 'dense' (every step reads it), 'lm_head' (the weight the logits read: sparrow's
    FP8 copy ``lm_head_fp8`` when it has one), 'embedding' (a step gathers B rows; when tied and without an
    'lm_head' entry it is the LM head, read whole), 'experts' (all of them; scaled by the hit fraction per step)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token."""
    tied: bool = False
    """The LM head is the embedding table."""
    hidden: int = 0
    """Hidden size (bytes of an embedding row = hidden x element size)."""
    kv_layers: list[tuple[int, int, int, int | None, int | None]] = field(default_factory=list)
    """Per attention layer: (KV heads, K head dim, V head dim, sliding window or None, bytes per KV element or None
    for ``element_size``: 1 in an fp8 KV cache)."""
    element_size: int = 2
    """Bytes per element of weights / KV cache."""
    embedding_row_bytes: int = 0
    """Bytes of one embedding row (a packed table's: its blocks); 0: hidden x ``element_size``."""

    def expert_hit_fraction(self, batch: int) -> float:
        """Expected fraction of a layer's experts that B tokens with uniform top-k routing touch:
        1 - (1 - k/E)^B (each expert is missed by one token with probability 1 - k/E)."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch

    def kv_bytes(self, batch: int, context: float) -> float:
        """K and V bytes a decode step reads for ``batch`` sequences at ``context`` tokens each."""
        per_seq = sum(h * (dk + dv) * min(context, w or context) * (e or self.element_size)
                      for h, dk, dv, w, e in self.kv_layers)
        return batch * per_seq

    def step_bytes(self, batch: int, context: float) -> dict[str, float]:
        """Bytes read by one decode step of ``batch`` sequences, by group, plus 'total'."""
        w = self.weight_bytes
        lm_head = w["lm_head"] if "lm_head" in w else w.get("embedding", 0) if self.tied else 0
        out = {"dense": float(w.get("dense", 0)), "lm_head": float(lm_head),
               "experts": w.get("experts", 0) * self.expert_hit_fraction(batch),
               "embedding": float(batch * (self.embedding_row_bytes or self.hidden * self.element_size)),  # gathered
               "kv": self.kv_bytes(batch, context)}
        out["total"] = sum(out.values())
        return out


def _first(cfg: dict, keys, default=0):
    for k in keys:
        if cfg.get(k):
            return cfg[k]
    return default


def footprint(model: torch.nn.Module, cfg: dict, tied: bool, hidden: int) -> Footprint:
    """Group ``model``'s parameters (sparrow's or transformers') for the bytes-per-step model; ``cfg`` is
    the HF config dict (expert count, top-k, vocab size). Every parameter and every buffer named ``*weight*``
    counts its stored bytes: packed GGUF blocks as they are (a GGUF linear's ``gguf_weight_0`` buffers, its
    experts' uint8 stacks), so a step's bytes are those the kernels read."""
    n_exp, top_k = int(_first(cfg, _EXPERT_COUNT_KEYS)), int(_first(cfg, _TOP_K_KEYS))
    groups: dict[str, int] = {}
    elt = 2
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if "weight" in n.rsplit(".", 1)[-1]]  # quantized weights
    for name, p in tensors:
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            group = "embedding"
            elt = p.element_size() if p.is_floating_point() else elt  # packed rows (uint8) are not the model dtype
        elif name.startswith("lm_head"):  # lm_head.* or sparrow's FP8 copy lm_head_fp8.* (never both)
            group = "lm_head"
        elif n_exp and ".experts." in name and p.dim() >= 3 and p.shape[0] == n_exp:
            group = "experts"
        else:
            group = "dense"
        groups[group] = groups.get(group, 0) + nbytes
    vocab = int(cfg.get("vocab_size") or 0)
    row_bytes = groups.get("embedding", 0) // vocab if vocab else 0  # whatever the table's format
    return Footprint(groups, n_exp, top_k, tied, hidden, _kv_layers(model), elt, row_bytes)


def _kv_layers(model) -> list[tuple[int, int, int, int | None, int | None]]:
    """(KV heads, K dim, V dim, window, KV element bytes) per attention layer: sparrow's Attention modules (the
    element size of the KV cache bound to each, once an engine allocated it), or transformers' attention modules
    (those with k_proj and head_dim; the model dtype's size)."""
    if hasattr(model, "attention_layers"):
        return [(a.num_kv_heads, a.head_dim, a.v_head_dim, a.sliding_window,
                 None if a.kv_cache is None else a.kv_cache.k.element_size()) for a in model.attention_layers()]
    out = []
    for mod in model.modules():
        k_proj, d = getattr(mod, "k_proj", None), getattr(mod, "head_dim", None)
        if k_proj is not None and d:
            out.append((k_proj.out_features // d, d, d, getattr(mod, "sliding_window", None), None))
    return out


# ---------------------------------------------------------------------------------------------- timing
