"""Triton paged attention (split-K decode, variable-length prefill, dispatcher) against paged_attention_ref.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; real Gemma 4 shapes run
under ``@pytest.mark.gpu``. Run as a script on a GPU to print decode attention GB/s against the measured
copy bandwidth. Tolerances: fp32 atol = rtol = 1e-4; bf16/fp16 atol = rtol = 2e-2 (probabilities are
rounded to the cache dtype before the P.V product, as in FlashAttention).
"""
from __future__ import annotations

import math

import pytest
import torch

from sparrow.kernels.attention.attention import (
    paged_attention, paged_decode_attention, paged_prefill_attention,
)
from sparrow.kernels import backend
from sparrow.kernels.attention.paged_attention import paged_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the small tests also run on a GPU machine
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-2, rtol=2e-2)}


def make_batch(q_lens, ctx_lens, hq, hkv, d, page, dtype, device=DEV, seed=0):
    """Random q / paged caches with shuffled pages (plus spare pages) and the step metadata."""
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(c / page) for c in ctx_lens]
    num_pages = sum(pages) + 3
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    block_tables = torch.zeros(len(ctx_lens), max(pages) + 1, dtype=torch.int32)  # one spare column
    used = 0
    for s, n in enumerate(pages):
        block_tables[s, :n] = perm[used:used + n]
        used += n
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens, qsl)]


def check(fn, batch, scale, window=None, cap=None, **kw):
    ref = paged_attention_ref(*batch, scale, window, cap)
    out = fn(*batch, scale, window, cap, **kw)
    torch.testing.assert_close(out, ref, **TOL[batch[0].dtype])


# (group, head dim, page size, dtype)
CASES = [
    (1, 64, 16, torch.float32),
    (2, 128, 32, torch.bfloat16),
    (4, 64, 16, torch.bfloat16),
    (8, 256, 16, torch.float32),
    (8, 128, 32, torch.bfloat16),
    (2, 256, 32, torch.bfloat16),
    (4, 512, 32, torch.bfloat16),
]


@pytest.mark.parametrize("group,d,page,dtype", CASES)
def test_decode(group, d, page, dtype):
    ctx = [1, 17, 33, 100] if d < 512 else [1, 40]
    batch = make_batch([1] * len(ctx), ctx, hq=group * (2 if group < 8 else 1), hkv=2 if group < 8 else 1,
                       d=d, page=page, dtype=dtype)
    check(paged_decode_attention, batch, 1 / math.sqrt(d))  # default splits (P > 1 here)
    check(paged_decode_attention, batch, 1 / math.sqrt(d), num_splits=1)  # no reduce pass
    check(paged_decode_attention, batch, 1 / math.sqrt(d), num_splits=5)  # short rows leave splits empty


@pytest.mark.parametrize("group,d,page,dtype", CASES)
def test_prefill_chunked(group, d, page, dtype):
    # fresh prompt, decode row, chunk starting mid-sequence, prompt longer than one query tile
    q_lens, ctx = ([5, 1, 19, 70], [5, 30, 45, 70]) if d < 512 else ([3, 1, 9], [3, 20, 40])
    batch = make_batch(q_lens, ctx, hq=group * (2 if group < 8 else 1), hkv=2 if group < 8 else 1,
                       d=d, page=page, dtype=dtype, seed=1)
    check(paged_prefill_attention, batch, 1 / math.sqrt(d))


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_edges(cap, dtype):
    w = 16
    ctx = [w - 1, w, w + 1, w + 2]
    decode = make_batch([1] * 4, ctx, hq=4, hkv=2, d=64, page=16, dtype=dtype, seed=2)
    check(paged_decode_attention, decode, 0.125, w, cap, num_splits=2)
    prefill = make_batch([w - 1, 3, w + 1, 1], ctx, hq=4, hkv=2, d=64, page=16, dtype=dtype, seed=3)
    check(paged_prefill_attention, prefill, 0.125, w, cap)


def test_reduce_merges_more_splits_than_one_tile():
    """Head dim 512: the reduce takes 16 splits per step, so 22 live splits need a full and a ragged step."""
    batch = make_batch([1, 1], [700, 300], hq=2, hkv=1, d=512, page=16, dtype=torch.bfloat16, seed=6)
    check(paged_decode_attention, batch, 1 / math.sqrt(512), num_splits=22)


@pytest.mark.parametrize("window", [None, 24, 150])
def test_decode_splits_sized_per_sequence_match_the_twin(window):
    """Splits chosen for max_seq_len 4,096 (a graph captured for long contexts) or forced: each sequence's
    partition is its own live keys (at most the window) over the splits, whole tiles each, so 300 keys use
    several splits and 5 keys one (a window of 24 fits one tile: one split); same numbers as the twin."""
    batch = make_batch([1, 1, 1, 1], [5, 40, 200, 300], hq=4, hkv=2, d=64, page=16, dtype=torch.float32, seed=8)
    check(paged_decode_attention, batch, 0.125, window, max_seq_len=4096)
    check(paged_decode_attention, batch, 0.125, window, num_splits=7)
    check(paged_decode_attention, batch, 0.125, window, num_splits=3, config=dict(BLOCK_N=16))


def test_window_longer_context_and_softcap_splits():
    # window much shorter than the context: splits start at ctx - W; fp16 q and cache
    batch = make_batch([1, 1], [90, 33], hq=8, hkv=2, d=64, page=16, dtype=torch.float16, seed=4)
    check(paged_decode_attention, batch, 1.0, 40, 30.0, num_splits=3)
    batch = make_batch([20, 33], [90, 33], hq=8, hkv=2, d=64, page=16, dtype=torch.float16, seed=5)
    check(paged_prefill_attention, batch, 1.0, 40, 30.0, config=dict(BLOCK_M=16, BLOCK_N=16))


def test_dispatcher():
    dec = make_batch([1, 1, 1], [3, 50, 17], hq=4, hkv=1, d=64, page=16, dtype=torch.float32, seed=6)
    mix = make_batch([4, 1, 9], [4, 50, 30], hq=4, hkv=1, d=64, page=16, dtype=torch.float32, seed=7)
    for batch in (dec, mix):
        ref = paged_attention_ref(*batch, 0.125, None, None)
        if DEV == "cpu":
            torch.testing.assert_close(paged_attention(*batch, 0.125), ref, atol=0, rtol=0)  # the twin
        with backend("triton"):
            torch.testing.assert_close(paged_attention(*batch, 0.125), ref, **TOL[torch.float32])


def test_rejects_bad_shapes():
    q, k, v, bt, sl, qsl = make_batch([1], [5], hq=4, hkv=2, d=64, page=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="Dv == D"):
        paged_decode_attention(q, k, v[..., :32].contiguous(), bt, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_prefill_attention(q[:, :3].contiguous(), k, v, bt, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="page size"):
        paged_prefill_attention(q, k.view(-1, 8, 2, 64), v.view(-1, 8, 2, 64), bt, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k, v, bt, sl.long(), qsl, 1.0)


# ---------------------------------------------------------------- GPU: real Gemma 4 shapes

GEMMA4 = [  # (head dim, q heads, kv heads, window)
    (256, 16, 8, 1024),
    (512, 16, 2, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv,window", GEMMA4)
def test_gemma4_decode_gpu(d, hq, hkv, window):
    ctx = [1, 15, 1023, 1024, 1025, 2000, 4097, 8192]
    batch = make_batch([1] * len(ctx), ctx, hq, hkv, d, 16, torch.bfloat16, device="cuda")
    check(paged_decode_attention, batch, 1.0 / 16, window, None)
    check(paged_decode_attention, batch, 1.0 / 16, window, 50.0, max_seq_len=8192)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv,window", GEMMA4)
def test_gemma4_prefill_gpu(d, hq, hkv, window):
    q_lens, ctx = [1, 700, 1025, 300, 2048], [1, 700, 1025, 3000, 8192]
    batch = make_batch(q_lens, ctx, hq, hkv, d, 16, torch.bfloat16, device="cuda")
    check(paged_prefill_attention, batch, 1.0 / 16, window, None)
    check(paged_attention, batch, 1.0 / 16, window, 50.0)


# ---------------------------------------------------------------- micro-benchmark

def _copy_bandwidth() -> float:
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: x.clone())
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def main() -> None:
    import triton.testing

    peak = _copy_bandwidth()
    print(f"copy bandwidth {peak:.0f} GB/s")
    for d, hq, hkv, window in GEMMA4:
        for batch_size, ctx in [(1, 1024), (1, 8192), (8, 4096), (32, 4096), (64, 8192)]:
            batch = make_batch([1] * batch_size, [ctx] * batch_size, hq, hkv, d, 16, torch.bfloat16, device="cuda")
            fn = lambda: paged_decode_attention(*batch, 1.0, window, None, max_seq_len=ctx)  # noqa: E731
            fn()  # compile outside the graph
            graph = torch.cuda.CUDAGraph()  # the engine replays decode in CUDA graphs: time the kernels only
            with torch.cuda.graph(graph):
                fn()
            ms = triton.testing.do_bench(graph.replay)
            kv = min(ctx, window or ctx)
            nbytes = batch_size * kv * hkv * 2 * d * 2 + 2 * batch_size * hq * d * 2
            gbs = nbytes / ms / 1e6
            print(f"D {d} Hq {hq} Hkv {hkv} W {window} batch {batch_size:3d} ctx {ctx:5d}: {ms * 1e3:8.1f} us "
                  f"{gbs:7.0f} GB/s ({100 * gbs / peak:4.1f} % of copy)")


if __name__ == "__main__":
    main()
