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
"""
from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k [R, Hkv, D] and v [R, Hkv, Dv] at ``slot_mapping`` [R] (int64; rows with slot < 0 are
    skipped) of k_cache [N, B, Hkv, D] / v_cache [N, B, Hkv, Dv], cast to the cache dtype. In place."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton twin of ``write_kv_ref`` (same contract); no host sync, so it can run inside a CUDA graph.
    Raises ValueError when a row of k / v is not contiguous or the pool is not contiguous."""
    import triton

    from sparrow.kernels._kv_write_jit import write_kv_kernel

    r = k.shape[0]
    if r == 0:
        return
    if k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]:
        raise ValueError("write_kv_triton: each row of k and v must be contiguous [Hkv, D]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv_triton: k_cache and v_cache must be contiguous")
    kd, vd = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    write_kv_kernel[(r,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), kd, vd,
                          BLOCK_K=min(1024, triton.next_power_of_2(kd)), BLOCK_V=min(1024, triton.next_power_of_2(vd)))


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Dispatcher: ``write_kv_triton`` where ``sparrow.kernels.use_triton(k)``, else ``write_kv_ref``."""
    from sparrow.kernels import use_triton

    (write_kv_triton if use_triton(k) else write_kv_ref)(k, v, k_cache, v_cache, slot_mapping)


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
) -> torch.Tensor:
    """Causal attention of q [R, Hq, D] over the paged cache; returns [R, Hq, Dv] in q's dtype.

    block_tables [S, M] int32, seq_lens [S] int32, query_start_loc [S+1] int32 (see module doc).
    Scores are ``scale * q.k`` (then ``soft_cap * tanh(s / soft_cap)`` if soft_cap), softmax in fp32.
    The K/V of this step's rows must already be written to the cache.
    """
    num_seqs = seq_lens.shape[0]
    r, hq, d = q.shape
    if r == num_seqs and r > 1:  # all decode rows (one query each): one batched computation, no loop
        return _decode_batched(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
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
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float().permute(1, 2, 0)  # [Hkv, D, L]
        v = v_cache[blocks].reshape(-1, hkv, dv)[:ctx].float().transpose(0, 1)  # [Hkv, L, Dv]
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


def _decode_batched(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap):
    """paged_attention_ref for S sequences of one query row each: K/V gathered for all sequences at once,
    padded to the longest context and masked. q [S, Hq, D] -> [S, Hq, Dv]."""
    s, hq, d = q.shape
    hkv, block_size, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[-1]
    group = hq // hkv
    max_len = int(seq_lens.max())
    nblocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[:, :nblocks].long()  # [S, nb]
    k = k_cache[blocks].reshape(s, -1, hkv, d)[:, :max_len].float()  # [S, L, Hkv, D]
    v = v_cache[blocks].reshape(s, -1, hkv, dv)[:, :max_len].float()
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
