"""Qwen3-MoE and Qwen2-MoE (references: transformers' Qwen3MoeForCausalLM, Qwen2MoeForCausalLM).

Both are the Llama pre-norm layer with a routed MoE feed-forward (softmax router, top-k, ``norm_topk_prob``)
on the layers picked by ``decoder_sparse_step`` / ``mlp_only_layers`` (dense GatedMLP elsewhere). The
config flags carry the differences: Qwen3-MoE has per-head q/k norms; Qwen2-MoE has a q/k/v bias and a
sigmoid-gated shared expert (``shared_expert``, ``shared_expert_gate``). Checkpoints may hold the experts
per expert (``mlp.experts.N.gate_proj.weight``, as transformers 5 still saves them) or fused 3-D
(``mlp.experts.gate_up_proj``).
"""
from __future__ import annotations

from sparrow.models.llama import LlamaDecoderLayer
from sparrow.models.base import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """The same module (the config flags carry Qwen2-MoE's differences), under its own name for messages."""
