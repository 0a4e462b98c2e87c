"""Gemma 4 text decoder (reference: transformers' Gemma4ForCausalLM / the text part of
Gemma4ForConditionalGeneration), the MoE layout of 26B-A4B (design §2).

Per layer (x the residual stream [R, H]):
    h   = x + post_attention_layernorm(attn(input_layernorm(x)))
    d   = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))            dense GeGLU branch
    m   = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))   MoE branch
    out = (h + post_feedforward_layernorm(d + m)) * layer_scalar
(without ``enable_moe_block``: out = (h + post_feedforward_layernorm(mlp(...))) * layer_scalar).
Attention (layers/attention.py): q/k norms, scale-free v_norm, scale 1.0; full layers have their own
head dim / KV heads, "proportional" RoPE, and with ``attention_k_eq_v`` no v_proj. Norms multiply by w
(Gemma4RMSNorm), not 1 + w. The embedding is scaled by sqrt(H); final logits are soft-capped.
Per-layer embeddings (PLE) and KV sharing are refused by the config (ModelConfig.from_hf).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.layers.attention import SelfAttention
from sparrow.layers.mlp import GatedMLP
from sparrow.layers.norm import RMSNorm
from sparrow.layers.router import Gemma4Router
from sparrow.models.base import CausalLM, make_experts


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps

        def norm():
            return RMSNorm(h, eps, kind="gemma4", dtype=dtype)

        self.input_layernorm = norm()
        self.self_attn = SelfAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, dtype=dtype)
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.moe = config.is_moe_layer(layer_idx)
        if self.moe:
            self.router = Gemma4Router(h, config.num_experts, config.num_experts_per_tok, eps, params_dtype=dtype)
            self.experts = make_experts(config, dtype)
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()

    def forward(self, x, residual, meta):
        # the layer ends with x * layer_scalar, so it hands the whole stream on (residual is always None)
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta))
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            weights, ids = self.router(h)  # the router reads the raw residual
            moe = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        return (h + self.post_feedforward_layernorm(out)) * self.layer_scalar, None


class Gemma4ForCausalLM(CausalLM):
    layer_cls = Gemma4DecoderLayer
    prefix_map = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
    skip_prefixes = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                     "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
