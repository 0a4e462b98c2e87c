"""MiniMax-M2 (reference: transformers' MiniMaxM2ForCausalLM): the Llama pre-norm layer with
- q_norm / k_norm over the whole q [Hq*D] / k [Hkv*D] projection (not per head), before RoPE;
- partial RoPE (``partial_rotary_factor`` or the legacy ``rotary_dim``: the first Dr dims of each head);
- a MoE on every layer: sigmoid router, ``e_score_correction_bias`` only selects the top-k, the unbiased
  sigmoid scores weigh them, renormalized. The bias lives on the block in checkpoints
  (``mlp.e_score_correction_bias`` / ``block_sparse_moe.e_score_correction_bias``); it is the router's here.
"""
from __future__ import annotations

from sparrow.models.base import CausalLM
from sparrow.models.llama import LlamaDecoderLayer


class MiniMaxM2ForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
    renames = ((".block_sparse_moe.", ".mlp."), (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))
