"""Llama-family decoders: Llama 2/3, SmolLM, Mistral (dense), Qwen2 (qkv bias), Qwen3 (q/k norm), and the
pre-norm MoE families built on the same layer (qwen3_moe.py, mixtral.py, minimax_m2.py): the feed-forward
block is a routed MoE on MoE layers (``make_mlp``). The differences are config flags read by the shared
blocks."""
from __future__ import annotations

import torch
from torch import nn

from sparrow.layers.attention import SelfAttention
from sparrow.layers.norm import RMSNorm
from sparrow.models.base import CausalLM, make_mlp


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the residual add is fused into the norms."""

    def __init__(self, config, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = SelfAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = make_mlp(config, layer_idx, dtype)

    def forward(self, x, residual, batch):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, batch=batch), residual


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
