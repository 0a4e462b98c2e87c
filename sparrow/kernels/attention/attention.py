"""Paged attention launchers: split-K decode, variable-length causal prefill, and a dispatcher.

Shapes: R = rows, S = sequences, Hq / Hkv = query / KV heads (G = Hq // Hkv), D = head dim (q, k),
Dv = value head dim (must equal D), N = pages in the pool, B = page size, M = max pages per sequence,
P = decode splits. Semantics (positions, window, soft-cap, cache layout) are those of
``paged_attention_ref`` in paged_attention.py, the torch twin and oracle of every function here.

Tile configs are data: ``DECODE_CONFIGS`` / ``PREFILL_CONFIGS`` keyed by the padded head dim;
pass ``config=`` to force one. ``sparrow.kernels.backend("triton")`` makes the dispatcher run the kernels even on CPU
(under TRITON_INTERPRET=1), for tests.
"""
from __future__ import annotations

import torch
import triton

from sparrow.kernels.attention._attention_jit import paged_decode_kernel, paged_decode_reduce_kernel, paged_prefill_kernel
from sparrow.kernels import interpreting, pdl_kwargs, use_triton
from sparrow.kernels.attention.paged_attention import _scale_args, paged_attention_ref

# head dim (padded to a power of two) -> tile config. BLOCK_D chunks the q.k product so D = 512 fits.
DECODE_CONFIGS: dict[int, dict[str, int]] = {
    64: dict(BLOCK_N=64, BLOCK_D=64, num_warps=4, num_stages=2),
    128: dict(BLOCK_N=64, BLOCK_D=128, num_warps=4, num_stages=2),
    256: dict(BLOCK_N=32, BLOCK_D=128, num_warps=4, num_stages=2),
    512: dict(BLOCK_N=32, BLOCK_D=128, num_warps=8, num_stages=2),
}
# 256 and 512: the fastest tiles of the H200 sweep (benchmarks/attention_prefill.py --tune, Gemma 4 shapes, 4 x 2048
# tokens; the figures are in benchmarks/README.md), ahead of torch SDPA on unpaged tensors. For D = 512, BLOCK_M = 64
# is faster than 128.
PREFILL_CONFIGS: dict[int, dict[str, int]] = {
    64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, num_warps=4, num_stages=2),
    128: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, num_warps=4, num_stages=2),
    256: dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, num_warps=8, num_stages=2),
    512: dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=128, num_warps=8, num_stages=2),
}
MAX_SPLITS = 64  # decode partitions per row; bounds the reduce's work and the partial buffers
_DEFAULT_SMS = 132  # H100/H200 SM count, used when the device is not CUDA (interpreter)



def _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sliding_window, soft_cap):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"paged attention wants q [R, Hq, D], k_cache [N, B, Hkv, D], v_cache [N, B, Hkv, Dv]; got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    n, b, hkv, dk = k_cache.shape
    if dk != d or tuple(v_cache.shape[:3]) != (n, b, hkv):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if v_cache.shape[3] != d:
        raise ValueError(f"paged attention kernels need Dv == D; got D {d}, Dv {v_cache.shape[3]}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if not 16 <= d <= 512:
        raise ValueError(f"head dim {d} outside the supported 16..512")
    if b < 16 or b & (b - 1):
        raise ValueError(f"page size {b} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head dim) axis")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} not supported (fp32, fp16, bf16)")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    s = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] < s or query_start_loc.shape[0] != s + 1:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}, query_start_loc "
            f"{tuple(query_start_loc.shape)} disagree on the number of sequences"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables needs a contiguous last axis")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")


def _common(q, k_cache, v_cache, sliding_window, soft_cap):
    d, dv = q.shape[2], v_cache.shape[3]
    return dict(
        HEAD_DIM=d, HEAD_DIM_PAD=max(16, triton.next_power_of_2(d)), DV=dv, DV_PAD=max(16, triton.next_power_of_2(dv)),
        PAGE=k_cache.shape[1], USE_WINDOW=sliding_window is not None, USE_SOFTCAP=soft_cap is not None,
        DOT_FP32=q.dtype == torch.float32 or k_cache.dtype == torch.float32,
        UPCAST=interpreting(),  # interpreter: 16-bit dots via fp32 (see dot16)
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


def _config(table: dict[int, dict[str, int]], d_pad: int, config: dict[str, int] | None) -> dict[str, int]:
    cfg = dict(table[min(max(d_pad, 64), 512)])
    if config:
        cfg.update(config)
    cfg["BLOCK_D"] = min(cfg["BLOCK_D"], d_pad)
    return cfg


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_n: int, device: torch.device) -> int:
    """Splits per decode row: enough (sequence, KV head, split) programs for ~2 waves of SMs, at least one
    KV tile per split, at most MAX_SPLITS. Depends only on host-side sizes (safe under CUDA graphs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _DEFAULT_SMS
    tiles = max(1, triton.cdiv(max_kv_len, block_n))
    want = triton.cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, tiles, MAX_SPLITS))


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None,
                           soft_cap=None, k_scale=None, v_scale=None, *, max_seq_len: int | None = None,
                           num_splits: int | None = None, config: dict[str, int] | None = None) -> torch.Tensor:
    """Split-K paged attention for steps whose rows are all single-token decodes; returns [R, Hq, Dv].

    Arguments as ``paged_attention_ref``, with one row per sequence: sequence s owns row
    ``query_start_loc[s]`` (query_start_loc must be arange(S + 1); not checked, to avoid a device sync).
    Each (sequence, KV head) splits its live keys into P partitions (flash-decoding); the G query heads of
    a KV head share each K/V tile. A second kernel merges the splits by log-sum-exp (skipped when P == 1).
    Each sequence's partition is its own live keys / P rounded up to a tile, computed in the kernels from
    seq_lens, so a short context is spread over P programs even in a graph captured for the longest.

    max_seq_len: host-side bound on seq_lens (default: the block table's capacity M * B); it and the batch
    size choose P, so pass a fixed value when capturing CUDA graphs. num_splits / config force P / tiles.
    k_scale / v_scale: [1] fp32 per-tensor scales of an FP8 (e4m3) pool, read in the kernel (None: 1.0);
    ignored for other pools. Raises ValueError on bad shapes, dtypes or strides.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sliding_window, soft_cap)
    num_seqs, (_, hq, _), hkv = seq_lens.shape[0], q.shape, k_cache.shape[2]
    out = torch.empty(q.shape[0], hq, v_cache.shape[3], dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    meta = _common(q, k_cache, v_cache, sliding_window, soft_cap)
    cfg = _config(DECODE_CONFIGS, meta["HEAD_DIM_PAD"], config)
    block_n = cfg.pop("BLOCK_N")
    max_kv = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
    if sliding_window is not None:
        max_kv = min(max_kv, sliding_window)
    splits = num_splits or num_decode_splits(num_seqs, hkv, max_kv, block_n, q.device)
    if num_splits is None:
        # drop the splits that stay empty even at max_kv once each split holds whole tiles (the kernels size
        # every sequence's splits from its own seq_len: _attention_jit._split_part)
        kv = max(max_kv, 1)
        splits = triton.cdiv(kv, triton.cdiv(triton.cdiv(kv, splits), block_n) * block_n)
    group = hq // hkv
    split = splits > 1
    if split:
        part_acc = torch.empty(num_seqs, hq, splits, v_cache.shape[3], dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, hq, splits, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_lse = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    ks, vs, _ = _scale_args(k_cache, k_scale, v_scale)
    paged_decode_kernel[(num_seqs, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_lse, ks, vs,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, SPLIT=split,
        **meta, **cfg, **pdl_kwargs(q),
    )
    if split:
        paged_decode_reduce_kernel[(num_seqs, hq)](
            part_acc, part_lse, seq_lens, query_start_loc, out, int(sliding_window or 0), splits,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            DV=meta["DV"], DV_PAD=meta["DV_PAD"], SPLITS_PAD=(splits_pad := max(2, triton.next_power_of_2(splits))),
            BLOCK_P=min(splits_pad, max(2, 8192 // meta["DV_PAD"])), USE_WINDOW=meta["USE_WINDOW"], BLOCK_N=block_n,
            num_warps=4,
            **pdl_kwargs(q),
        )
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None,
                            soft_cap=None, k_scale=None, v_scale=None, *, config: dict[str, int] | None = None
                            ) -> torch.Tensor:
    """Causal paged attention for any mix of rows (prefill chunks, chunked prefill, decode); returns
    [R, Hq, Dv]. Arguments and semantics as ``paged_attention_ref``; earlier context is read from the pool,
    so chunked prefill and prefix-cache hits work. Grid (R // BLOCK_M + S, Hq): no host sync, no per-step
    metadata beyond the reference's. ``config`` forces tiles. k_scale / v_scale: as ``paged_decode_attention``.
    Raises ValueError on bad shapes/dtypes."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sliding_window, soft_cap)
    num_seqs, (rows, hq, _), hkv = seq_lens.shape[0], q.shape, k_cache.shape[2]
    out = torch.empty(rows, hq, v_cache.shape[3], dtype=q.dtype, device=q.device)
    if num_seqs == 0 or rows == 0:
        return out
    meta = _common(q, k_cache, v_cache, sliding_window, soft_cap)
    cfg = _config(PREFILL_CONFIGS, meta["HEAD_DIM_PAD"], config)
    if meta["DOT_FP32"] and meta["HEAD_DIM_PAD"] >= 256 and not (config and "num_stages" in config):
        cfg["num_stages"] = 1  # fp32 tiles at D >= 256 outgrow shared memory when pipelined (295 KB > 227 KB, H100)
    grid = (rows // cfg["BLOCK_M"] + num_seqs, hq)
    ks, vs, _ = _scale_args(k_cache, k_scale, v_scale)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, ks, vs,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0), num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, **meta, **cfg,
    )
    return out


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None,
                    soft_cap=None, k_scale=None, v_scale=None) -> torch.Tensor:
    """``paged_attention_ref``'s contract (and parameter types), run by the fastest path: on CUDA (or under
    ``sparrow.kernels.backend("triton")``) the split-K decode kernel when R == S (one row per sequence: the caller
    guarantees query_start_loc == arange(S + 1), i.e. no zero-length sequence), else the prefill kernel;
    on CPU the torch reference."""
    if not use_triton(q):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                   sliding_window, soft_cap, k_scale, v_scale)
    if q.shape[0] == seq_lens.shape[0]:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      sliding_window, soft_cap, k_scale, v_scale)
    return paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                   sliding_window, soft_cap, k_scale, v_scale)
