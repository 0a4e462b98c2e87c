"""Mixtral (reference: transformers' MixtralForCausalLM): the Llama pre-norm layer with a routed MoE
feed-forward (softmax router, top-k, always renormalized), optional sliding window on every layer.
Original checkpoints name the block ``block_sparse_moe`` and the experts ``w1`` (gate), ``w3`` (up),
``w2`` (down); both those and transformers 5's fused ``mlp.experts.gate_up_proj`` load."""
from __future__ import annotations

from sparrow.models.base import CausalLM
from sparrow.models.llama import LlamaDecoderLayer


class MixtralForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
    renames = ((".block_sparse_moe.", ".mlp."),)
