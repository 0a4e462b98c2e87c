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

    chains_norms = True  # DecoderModel passes input_layernorm(x) and the norm after this layer (gemma4.py)

    def forward(self, x, normed, batch, next_norm):
        """x [R, H] the residual stream, normed = input_layernorm(x); returns (out, next_norm(out)).
        HF: h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h))); each norm
        chain between two matmuls is one kernel on the Triton path (RMSNorm.norm_add)."""
        h, pre = self.post_attention_layernorm.norm_add(self.self_attn(normed, batch), x,
                                                        next_norms=(self.pre_feedforward_layernorm,))
        return self.post_feedforward_layernorm.norm_add(self.mlp(pre, batch), h, next_norms=(next_norm,))


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer
    prefix_map = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
    skip_prefixes = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                     "multi_modal_projector.")
