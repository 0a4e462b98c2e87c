"""The causal-LM skeleton every architecture shares: embedding -> decoder layers -> final norm -> LM head.

A model file supplies its decoder layer class; this module holds the rest and the weight-name table
(style.md 5): checkpoint names stay HF's, packed projections are declared in ``packed_modules``.
Shapes: R = rows of the step, H = hidden, V = vocab, S' = rows whose logits are computed.
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.config import ModelConfig
from sparrow.layers.attention import AttentionMetadata
from sparrow.layers.embedding import VocabEmbedding
from sparrow.layers.logits import LogitsProcessor
from sparrow.layers.norm import RMSNorm


class DecoderModel(nn.Module):
    """HF ``model.``: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, layer_cls, dtype: torch.dtype):
        super().__init__()
        scale = config.hidden_size**0.5 if config.is_gemma else None
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale, dtype)
        self.layers = nn.ModuleList(layer_cls(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=config.is_gemma, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, soft_embeds=None, soft_mask=None):
        x = self.embed_tokens(input_ids, soft_embeds, soft_mask)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """forward(input_ids [R], meta) -> hidden [R, H]; compute_logits(hidden [S', H]) -> [S', V] fp32."""

    layer_cls: type = None
    # checkpoint module name -> (packed module name, shard index)
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint name prefixes that are not part of the text decoder (skipped with a log line)
    skip_prefixes: tuple[str, ...] = ()
    # checkpoint prefix -> sparrow prefix (e.g. multimodal checkpoints nest the text model)
    prefix_map: dict[str, str] = {}

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_cls, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.logits_processor = LogitsProcessor(config.final_logit_softcapping)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, soft_embeds=None, soft_mask=None):
        return self.model(input_ids, meta, soft_embeds, soft_mask)

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(hidden, self.lm_weight)

    def resolve_weight(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) for a checkpoint tensor name; None for tensors outside the text
        decoder (skipped). Shard ids index packed projections (``packed_modules``)."""
        for src, dst in self.prefix_map.items():
            if name.startswith(src):
                name = dst + name[len(src):]
                break
        if name.startswith(self.skip_prefixes) or name.endswith("rotary_emb.inv_freq"):
            return None
        if self.config.tie_word_embeddings and name.startswith("lm_head."):
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules:
                packed, shard = self.packed_modules[part]
                return ".".join(parts[:i] + [packed] + parts[i + 1:]), shard
        return name, None

    def attention_layers(self):
        """Every Attention module, in layer order (the ModelRunner binds a KV cache to each)."""
        from sparrow.layers.attention import Attention

        return [m for m in self.modules() if isinstance(m, Attention)]
