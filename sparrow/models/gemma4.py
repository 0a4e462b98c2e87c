"""Gemma 4 text decoder (reference: transformers' Gemma4ForCausalLM / the text part of
Gemma4ForConditionalGeneration), the MoE layout of 26B-A4B.

Per layer (x the residual stream [R, H]):
    h   = x + post_attention_layernorm(attn(input_layernorm(x)))
    d   = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))            dense GeGLU branch
    m   = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))   MoE branch
    out = (h + post_feedforward_layernorm(d + m)) * layer_scalar
(without ``enable_moe_block``: out = (h + post_feedforward_layernorm(mlp(...))) * layer_scalar).
Each chain of norms between two matmuls is one kernel (Gemma4DecoderLayer.forward).
Decode overlap: while a CUDA graph is being captured, the dense branch d runs on a second CUDA
stream, concurrent with router + experts on the capturing stream, and joins before the sum; the graph
keeps the fork/join, so every replay overlaps them. Eager steps (prefill) run the branches in order.
``SPARROW_DUAL_STREAM=0`` (``sparrow.switches.DUAL_STREAM``) turns the overlap off (read when the LLM captures
its graphs).
Attention (layers/attention.py): q/k norms, scale-free v_norm, scale 1.0; full layers have their own
head dim / KV heads, "proportional" RoPE, and with ``attention_k_eq_v`` no v_proj. Norms multiply by w
(Gemma4RMSNorm), not 1 + w. The embedding is scaled by sqrt(H); final logits are soft-capped.
Per-layer embeddings (PLE) and KV sharing are refused by the config (ModelConfig.from_hf).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from sparrow import switches
from sparrow.kernels.common import split_k
from sparrow.layers.attention import SelfAttention
from sparrow.layers.mlp import GatedMLP
from sparrow.layers.norm import RMSNorm
from sparrow.layers.router import Gemma4Router
from sparrow.models.base import CausalLM, make_experts

"""Overlap the dense MLP with the MoE branch on a side stream inside captured decode graphs."""

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(x: torch.Tensor) -> "torch.cuda.Stream | None":
    """The side stream of x's device when the dense branch should overlap (CUDA, capturing, enabled)."""
    if not (switches.DUAL_STREAM and x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    stream = _SIDE_STREAMS.get(x.device)
    if stream is None:
        stream = _SIDE_STREAMS[x.device] = torch.cuda.Stream(x.device)
        split_k.register_concurrent_stream(stream)  # its own split-K workspace: it overlaps the main stream
    return stream


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

    chains_norms = True
    """DecoderModel hands each layer its input already normalized by input_layernorm and the norm that
    follows it (the next layer's input_layernorm, the final norm after the last layer)."""

    def forward(self, x, normed, batch, next_norm):
        """x [R, H] the residual stream, normed = input_layernorm(x); returns (out, next_norm(out)).

        Each chain of norms between two matmuls is one kernel on the Triton path (RMSNorm.norm_add): the
        post-attention add with both pre-feedforward norms, and the closing kernel (the experts' weighted
        reduce, both branch post-norms, their sum, post_feedforward_layernorm + residual, x layer_scalar, then
        next_norm)."""
        attn = self.self_attn(normed, batch)
        if not self.moe:
            h, pre = self.post_attention_layernorm.norm_add(attn, x, next_norms=(self.pre_feedforward_layernorm,))
            return self.post_feedforward_layernorm.norm_add(self.mlp(pre, batch), h, self.layer_scalar,
                                                            next_norms=(next_norm,))
        h, pre, pre2 = self.post_attention_layernorm.norm_add(
            attn, x, next_norms=(self.pre_feedforward_layernorm, self.pre_feedforward_layernorm_2))
        stream = side_stream(h)  # fork: the dense branch on the side stream, joined before the sum
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(h.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dense = self.mlp(pre, batch)
        weights, ids = self.router(h)  # the router reads the raw residual
        if self.experts.shards.mode is not None:  # several ranks: the experts combine (sum) their outputs
            moe, weights = self.experts(pre2, weights, ids, batch=batch), None
        else:
            moe = self.experts(pre2, weights, ids, reduce=False, batch=batch)  # [R K, H]: the reduce is fused below
        if stream is not None:
            torch.cuda.current_stream(h.device).wait_stream(stream)
        # (h + post_feedforward_layernorm(post_feedforward_layernorm_1(dense) + post_feedforward_layernorm_2(
        # sum_k weights[:, k] moe[:, k]))) x layer_scalar, and next_norm of it
        return self.post_feedforward_layernorm.norm_add(
            moe, h, self.layer_scalar, pre=(self.post_feedforward_layernorm_2, dense),
            pre_add_norm=self.post_feedforward_layernorm_1, next_norms=(next_norm,), pair_weights=weights)


class Gemma4ForCausalLM(CausalLM):
    layer_cls = Gemma4DecoderLayer
    prefix_map = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
    skip_prefixes = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                     "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
