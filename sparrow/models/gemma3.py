"""Gemma 3 text decoder (reference: transformers' Gemma3ForCausalLM): scaled embedding, (1 + w) norms,
q/k norms, sandwich norms around attention and MLP, sliding-window layers with their own rope theta,
GELU-tanh MLP, tied LM head."""
from __future__ import annotations

import torch
from torch import nn

from sparrow.layers.attention import SelfAttention
from sparrow.layers.mlp import GatedMLP
from sparrow.layers.norm import RMSNorm
from sparrow.models.base import CausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, gemma=True, dtype=dtype)
        self.self_attn = SelfAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, gemma=True, dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, gemma=True, dtype=dtype)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, gemma=True, dtype=dtype)

    def forward(self, x, residual, meta):
        # HF: h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))
        if residual is not None:
            x = x + residual
        residual = x
        x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer
    prefix_map = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
    skip_prefixes = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                     "multi_modal_projector.")
