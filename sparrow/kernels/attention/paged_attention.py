"""Paged attention over a block-table KV cache: torch reference (the CPU path and the kernels' oracle).

Shapes: R = rows (query tokens of the step, all sequences concatenated), S = sequences in the step,
Hq / Hkv = query / KV heads (GQA: Hq % Hkv == 0), D = head dim of q and k, Dv = head dim of v,
N = blocks in the pool, B = block size, M = max blocks per sequence.

Cache layout (per layer): k_cache [N, B, Hkv, D], v_cache [N, B, Hkv, Dv]; token t of a sequence lives
at slot ``block_tables[s, t // B] * B + t % B``; ``slot = block * B + offset`` flattens the pool.

Sequence s owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` (q_len of them); after this
step it holds ``seq_lens[s]`` tokens, so its query j sits at position ``seq_lens[s] - q_len + j`` and
sees keys at positions p with ``p <= pos`` and, with a sliding window W, ``pos - p < W``
(Gemma / Mistral convention: i - W < j <= i).

FP8 pools (``torch.float8_e4m3fn``, ``sparrow.kv_cache``): each layer has per-tensor scales k_scale / v_scale,
fp32 tensors of shape [1] on the cache's device (read on the device, so CUDA graphs see updates). A write stores
``clamp(x / scale, -448, 448)`` rounded to nearest e4m3 (``quantize_kv_ref``); a read uses ``stored * scale``
(``dequantize_kv_ref``). Pools of another dtype ignore the scales (plain casts).
"""
from __future__ import annotations

import torch

from sparrow.kernels import dispatch

FP8_KV_DTYPE = torch.float8_e4m3fn
"""Storage dtype of FP8 KV pools (e4m3, finite max 448)."""
FP8_KV_MAX = 448.0


def is_fp8_kv(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an FP8 pool (whose reads and writes apply the layer's scales)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x (any float dtype) as stored in a pool of ``cache_dtype``: a cast, or for FP8 ``clamp(x / scale, -448,
    448)`` in fp32 rounded to nearest e4m3 (scale: [1] fp32; None: 1.0)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    y = x.float()
    if scale is not None:
        y = y / scale
    return y.clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored pool values as fp32: ``x * scale`` for FP8 (scale [1] fp32; None: 1.0), else ``x.float()``."""
    if x.dtype != FP8_KV_DTYPE or scale is None:
        return x.float()
    return x.float() * scale


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Store k [R, Hkv, D] and v [R, Hkv, Dv] at ``slot_mapping`` [R] (int64; rows with slot < 0 are
    skipped) of k_cache [N, B, Hkv, D] / v_cache [N, B, Hkv, Dv], converted by ``quantize_kv_ref`` (a cast;
    FP8 pools: divided by k_scale / v_scale, [1] fp32, saturated, rounded). In place."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        x = quantize_kv_ref(x, cache.dtype, scale)
        if cache.dtype == FP8_KV_DTYPE:  # torch has no index_copy_ for fp8 (CPU): copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)


def _scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """(k_scale, v_scale, KV_FP8) for a kernel launch: the scales of an FP8 pool (1.0 tensors when None), else
    k_cache itself as an unread placeholder. Raises ValueError for a scale that is not a [1] fp32 tensor on the
    pool's device."""
    if not is_fp8_kv(k_cache):
        return k_cache, k_cache, False
    one = None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            one = one if one is not None else torch.ones(1, dtype=torch.float32, device=k_cache.device)
            s = one
        elif s.dtype != torch.float32 or s.numel() != 1 or s.device != k_cache.device:
            raise ValueError(f"{name} must be a [1] float32 tensor on {k_cache.device}, got {s.dtype} "
                             f"{tuple(s.shape)} on {s.device}")
        out.append(s)
    return out[0], out[1], True


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Triton twin of ``write_kv_ref`` (same contract); no host sync, so it can run inside a CUDA graph.
    Raises ValueError when a row of k / v is not contiguous, the pool is not contiguous, k and v pools
    differ in dtype, or a scale is not [1] fp32 on the pool's device."""
    import triton

    from sparrow.kernels import interpreting
    from sparrow.kernels.attention._kv_write_jit import write_kv_kernel

    r = k.shape[0]
    if r == 0:
        return
    if k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]:
        raise ValueError("write_kv_triton: each row of k and v must be contiguous [Hkv, D]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv_triton: k_cache and v_cache must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"write_kv_triton: k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    ks, vs, fp8 = _scale_args(k_cache, k_scale, v_scale)
    kd, vd = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    write_kv_kernel[(r,)](k, v, k_cache, v_cache, slot_mapping, ks, vs, k.stride(0), v.stride(0), kd, vd,
                          BLOCK_K=min(1024, triton.next_power_of_2(kd)), BLOCK_V=min(1024, triton.next_power_of_2(vd)),
                          KV_FP8=fp8, EMULATE_FP8=fp8 and interpreting())


write_kv = dispatch("write_kv", write_kv_triton, write_kv_ref,
                    """``write_kv_triton`` where ``sparrow.kernels.use_triton(k)``, else ``write_kv_ref``.""")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [R, Hq, D] over the paged cache; returns [R, Hq, Dv] in q's dtype.

    block_tables [S, M] int32, seq_lens [S] int32, query_start_loc [S+1] int32 (see module doc).
    Scores are ``scale * q.k`` (then ``soft_cap * tanh(s / soft_cap)`` if soft_cap), softmax in fp32.
    FP8 pools are read as ``stored * k_scale`` / ``stored * v_scale`` ([1] fp32; None: 1.0; module doc).
    The K/V of this step's rows must already be written to the cache.
    """
    num_seqs = seq_lens.shape[0]
    r, hq, d = q.shape
    if r == num_seqs and r > 1:  # all decode rows (one query each): one batched computation, no loop
        return _decode_batched(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap,
                               k_scale, v_scale)
    hkv, block_size, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[-1]
    group = hq // hkv
    out = torch.empty(r, hq, dv, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s in range(num_seqs):
        q0, q1, ctx = starts[s], starts[s + 1], lens[s]
        lq = q1 - q0
        if lq == 0:
            continue
        nblocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[s, :nblocks].long()
        k = dequantize_kv_ref(k_cache[blocks].reshape(-1, hkv, d)[:ctx], k_scale).permute(1, 2, 0)  # [Hkv, D, L]
        v = dequantize_kv_ref(v_cache[blocks].reshape(-1, hkv, dv)[:ctx], v_scale).transpose(0, 1)  # [Hkv, L, Dv]
        qs = q[q0:q1].float().reshape(lq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * lq, d)
        scores = torch.bmm(qs, k).mul_(scale)  # [Hkv, G*Lq, L], rows ordered (g, query)
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if lq > 1 or sliding_window is not None:
            q_pos = torch.arange(ctx - lq, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= q_pos - k_pos < sliding_window
            scores = scores.view(hkv, group, lq, ctx).masked_fill(~visible, float("-inf")).view(hkv, group * lq, ctx)
        probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, v).view(hkv, group, lq, dv).permute(2, 0, 1, 3).reshape(lq, hq, dv)
        out[q0:q1] = o.to(q.dtype)
    return out


def _decode_batched(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, k_scale, v_scale):
    """paged_attention_ref for S sequences of one query row each: K/V gathered for all sequences at once,
    padded to the longest context and masked. q [S, Hq, D] -> [S, Hq, Dv]."""
    s, hq, d = q.shape
    hkv, block_size, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[-1]
    group = hq // hkv
    max_len = int(seq_lens.max())
    nblocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[:, :nblocks].long()  # [S, nb]
    k = dequantize_kv_ref(k_cache[blocks].reshape(s, -1, hkv, d)[:, :max_len], k_scale)  # [S, L, Hkv, D]
    v = dequantize_kv_ref(v_cache[blocks].reshape(s, -1, hkv, dv)[:, :max_len], v_scale)
    qs = q.float().view(s, hkv, group, d)
    scores = torch.einsum("shgd,slhd->shgl", qs, k) * scale  # [S, Hkv, G, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos = torch.arange(max_len, device=q.device)[None, :]
    q_pos = (seq_lens.long() - 1)[:, None]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgl,slhd->shgd", probs, v)
    return out.reshape(s, hq, dv).to(q.dtype)
