"""Attention over the paged KV cache (the step layout comes from the ForwardBatch every layer reads).

Shapes: R = rows of the step, S = sequences, Hq / Hkv = query / KV heads, D = head dim,
N = KV blocks in the pool, B = block size, M = max blocks per sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.distributed import divide, tp_rank, tp_size
from sparrow.errors import ModelLoadError
from sparrow.kernels import use_triton
from sparrow.kernels.attention.paged_attention import paged_attention_ref
from sparrow.layers.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends (q [R, Hq, D] -> [R, Hq, Dv]).

    ``kv_cache`` is bound by the ModelRunner's ``sparrow.kv_cache.KVCache`` when the pool is allocated: this
    layer's LayerKVCache (k [N, B, Hkv, D], v [N, B, Hkv, Dv] in the model dtype or FP8 e4m3, k_scale / v_scale).
    ``checkpoint_kv_scales``: (k_scale, v_scale) read from the checkpoint, if any, for an FP8 pool."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None, v_head_dim: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.kv_cache = None  # sparrow.kv_cache.LayerKVCache
        self.checkpoint_kv_scales: tuple[float, float] | None = None  # sparrow.kv_cache.checkpoint

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self.kv_cache.write(k, v, batch.slot_mapping)
        return self.attend(q, batch)

    def attend(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention over the cache alone: this step's K/V must already be written at ``batch.slot_mapping``."""
        c = self.kv_cache
        if use_triton(q):  # the Triton dispatcher: split-K decode or varlen prefill kernel
            from sparrow.kernels.attention.attention import paged_attention as fn
        else:
            fn = paged_attention_ref
        return fn(q, c.k, c.v, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                  self.scale, self.sliding_window, self.soft_cap, c.k_scale, c.v_scale)


def local_heads(num_heads: int, num_kv_heads: int, layer_idx: int = 0) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of this tensor-parallel rank: the query heads split evenly; KV heads
    split evenly when there are at least as many as ranks, else replicated (each rank holds the one KV head its
    query heads read: rank r of T holds head r // (T / num_kv_heads)). Raises ModelLoadError when the heads do not
    split over the ranks."""
    world, rank = tp_size(), tp_rank()
    hq = divide(num_heads, world, f"layer {layer_idx}'s num_attention_heads")
    if num_kv_heads >= world:
        hkv = divide(num_kv_heads, world, f"layer {layer_idx}'s num_key_value_heads")
        return hq, hkv, rank * hkv
    if world % num_kv_heads:
        raise ModelLoadError(f"layer {layer_idx}'s num_key_value_heads ({num_kv_heads}) neither divides nor is a "
                             f"multiple of tensor_parallel_size={world}")
    return hq, 1, rank // (world // num_kv_heads)


class SelfAttention(nn.Module):
    """The attention block of a decoder layer, shared by every architecture:
    qkv_proj -> (q_norm / k_norm, per head or over all heads) -> RoPE -> paged attention -> o_proj.

    x [R, H] -> [R, H]. HF names: qkv_proj packs q_proj | k_proj | v_proj; q_norm, k_norm, o_proj.
    Tensor parallel: qkv_proj is column-parallel over heads (``local_heads``), o_proj row-parallel (one all-reduce);
    the Attention (and so the KV cache sized from it) holds this rank's heads; whole-projection q/k norms sum their
    squares over the ranks (``ShardedRMSNorm``).
    Config flags read here: ``qk_norm`` / ``qk_norm_per_head`` (MiniMax-M2 norms the whole [Hq*D] / [Hkv*D]
    projection), ``attention_k_eq_v`` (Gemma 4 full layers: no v_proj, V = the raw K projection), Gemma 4's
    scale-free v_norm, per-layer head dim / KV heads / window / rope / rotary dim from ``config.layers``.
    On the Triton path the per-head q/k norms, v_norm, RoPE and the K/V cache write are one kernel
    (``sparrow.kernels.norm_rope.rope.qk_norm_rope_kv_write``), except on the step that measures FP8 KV scales
    (calculate_kv_scales: the cache measures K after norm and RoPE, then writes); MiniMax-M2's whole-projection
    norms stay separate."""

    def __init__(self, config, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        from sparrow.layers.linear import Linear
        from sparrow.layers.norm import RMSNorm, ShardedRMSNorm
        from sparrow.layers.rotary import RotaryEmbedding

        spec = config.layers[layer_idx]
        full_hq, full_hkv, d = config.num_attention_heads, spec.num_kv_heads, spec.head_dim
        hq, hkv, kv_first = local_heads(full_hq, full_hkv, layer_idx)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.k_eq_v = config.attention_k_eq_v and spec.layer_type == "full_attention"
        sizes = [full_hq * d, full_hkv * d] if self.k_eq_v else [full_hq * d, full_hkv * d, full_hkv * d]
        q_range, kv_range = (tp_rank() * hq * d, hq * d), (kv_first * d, hkv * d)
        ranges = [q_range, kv_range] if self.k_eq_v else [q_range, kv_range, kv_range]
        self.qkv_proj = Linear(config.hidden_size, output_sizes=sizes, bias=config.attention_bias, dtype=dtype,
                               parallel="column", shard_ranges=ranges)
        self.o_proj = Linear(full_hq * d, config.hidden_size, bias=config.get("attention_out_bias", False),
                             dtype=dtype, parallel="row")
        kind = config.norm_kind
        self.per_head_norm = config.qk_norm_per_head
        if config.qk_norm and not self.per_head_norm and tp_size() > 1:  # over the ranks' shares of the projection
            if kind != "llama":
                raise ModelLoadError(f"layer {layer_idx}: whole-projection q/k norms of kind {kind!r} are not "
                                     "supported with tensor_parallel_size > 1")
            eps = config.rms_norm_eps
            self.q_norm = ShardedRMSNorm(full_hq * d, q_range[0], hq * d, eps, dtype)
            self.k_norm = ShardedRMSNorm(full_hkv * d, kv_range[0], hkv * d, eps, dtype)
        elif config.qk_norm:
            qn, kn = (d, d) if self.per_head_norm else (hq * d, hkv * d)
            self.q_norm = RMSNorm(qn, config.rms_norm_eps, kind=kind, dtype=dtype)
            self.k_norm = RMSNorm(kn, config.rms_norm_eps, kind=kind, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        # Gemma 4 normalizes V without a scale (Gemma4TextAttention.v_norm)
        self.v_norm = RMSNorm(d, config.rms_norm_eps, kind=kind, with_scale=False) if kind == "gemma4" else None
        if spec.rotary_dim is not None:
            rotary_dim = spec.rotary_dim
        else:
            rotary_dim = int(d * float(config.get("partial_rotary_factor", 1.0)))
        self.rotary = RotaryEmbedding(d, rotary_dim, config.max_position_embeddings, spec.rope)
        scale = config.attn_scale if config.attn_scale is not None else d**-0.5
        self.attn = Attention(hq, hkv, d, scale, spec.sliding_window, config.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        r = x.shape[0]
        qkv = self.qkv_proj(x, batch)
        if self.k_eq_v:
            q, k = qkv.split([self.hq * self.d, self.hkv * self.d], dim=-1)
            v = k
        else:
            q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        if self.q_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(r, self.hq, self.d), k.view(r, self.hkv, self.d), v.view(r, self.hkv, self.d)
        # the fused kernel writes K / V itself: not on the step that measures the FP8 scales (calculate_kv_scales)
        if use_triton(q) and (self.q_norm is None or self.per_head_norm) and not self.attn.kv_cache.measure:
            out = self._fused_norm_rope_write(q, k, None if self.k_eq_v else v, batch)
        else:
            if self.q_norm is not None and self.per_head_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.v_norm is not None:
                v = self.v_norm(v)
            q, k = self.rotary(batch.positions, q, k)
            out = self.attn(q, k, v, batch)
        return self.o_proj(out.reshape(r, self.hq * self.d), batch)

    def _fused_norm_rope_write(self, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        """Triton path: per-head q/k norm, RoPE, v-norm and the K/V cache write in one kernel, then attention.
        v is None on K=V layers (the kernel takes V from the raw k)."""
        from sparrow.kernels.norm_rope.rope import qk_norm_rope_kv_write

        c = self.attn.kv_cache
        norm = self.q_norm
        kind = norm.kind if norm is not None else "llama"
        eps = norm.eps if norm is not None else (self.v_norm.eps if self.v_norm is not None else 1e-6)
        q, _ = qk_norm_rope_kv_write(
            q, k, v, batch.positions, self.rotary.cos_sin_cache(q.device), self.rotary.rotary_dim,
            None if norm is None else norm.weight, None if norm is None else self.k_norm.weight, eps,
            gemma_norm=kind != "llama", v_norm=self.v_norm is not None, k_eq_v=v is None,
            k_cache=c.k, v_cache=c.v, slot_mapping=batch.slot_mapping,
            norm_offset=1.0 if kind == "gemma" else 0.0, k_scale=c.k_scale, v_scale=c.v_scale)
        return self.attn.attend(q, batch)
