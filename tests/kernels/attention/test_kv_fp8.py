"""FP8 (e4m3) KV pools: every kernel that writes or reads them against its torch twin (TRITON_INTERPRET=1 on CPU,
small shapes; the same tests run on a GPU), with non-unit per-tensor scales.

Writes (KV write, fused rope + KV write) are bit-exact against the twin (the interpreter rounds to e4m3 in fp32,
``_fp8_jit.round_e4m3``; on a GPU the hardware conversion, and one e4m3 step is allowed in 1 % of elements).
Attention over an FP8 pool: fp32 q atol = rtol = 1e-4; bf16 q atol = rtol = 2e-2 (as tests/kernels/attention/test_attention.py).
A wrong k_scale or v_scale must change the kernels' output (the scales reach the kernel).
"""
from __future__ import annotations

import math

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.attention.attention import paged_decode_attention, paged_prefill_attention
from sparrow.kernels.attention.paged_attention import (
    FP8_KV_DTYPE, dequantize_kv_ref, paged_attention_ref, quantize_kv_ref, write_kv_ref, write_kv_triton,
)
from sparrow.kernels.norm_rope.rope import build_cos_sin_cache, qk_norm_rope_kv_write, qk_norm_rope_kv_write_ref
from tests.kernels.attention.test_attention import TOL, make_batch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def scale(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32, device=DEV)


def assert_fp8_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact on CPU (interpreter); on a GPU at most 1 % of the elements one e4m3 step apart."""
    g, w = got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()
    if DEV == "cpu":
        assert torch.equal(g, w), f"{int((g != w).sum())} of {g.numel()} e4m3 values differ"
        return
    diff = (g.int() - w.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 0.01


def fp8_batch(q_lens, ctx_lens, hq, hkv, d, q_dtype, k_scale, v_scale, seed=0):
    """make_batch's q and tables with its K / V (x 3, so values pass 1) stored as e4m3 with the given scales."""
    q, kc, vc, bt, sl, qsl = make_batch(q_lens, ctx_lens, hq, hkv, d, 16, torch.float32, seed=seed)
    kc = quantize_kv_ref(3 * kc, FP8_KV_DTYPE, scale(k_scale))
    vc = quantize_kv_ref(3 * vc, FP8_KV_DTYPE, scale(v_scale))
    return [q.to(q_dtype), kc, vc, bt, sl, qsl]


@pytest.mark.parametrize("rows,hkv,d,dtype,ks,vs", [(1, 1, 64, torch.float32, 1.0, 1.0),
                                                    (5, 2, 96, torch.bfloat16, 0.02, 0.5),
                                                    (17, 4, 32, torch.float16, 3.0, 0.007)])
def test_write_kv_fp8_matches_twin(rows, hkv, d, dtype, ks, vs):
    g = torch.Generator().manual_seed(rows)
    n, b = 6, 16
    k = (4 * torch.randn(rows, hkv, d, generator=g)).to(dtype).to(DEV)
    v = (4 * torch.randn(rows, hkv, d, generator=g)).to(dtype).to(DEV)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])  # saturates to +-448; zero; below the smallest subnormal
    slots = torch.randperm(n * b, generator=g)[:rows]
    slots[1::3] = -1  # skipped rows
    slots = slots.to(DEV)
    caches = [torch.zeros(n, b, hkv, d, device=DEV).to(FP8_KV_DTYPE) for _ in range(2)]
    ref = [c.clone() for c in caches]
    write_kv_ref(k, v, ref[0], ref[1], slots, scale(ks), scale(vs))
    write_kv_triton(k, v, caches[0], caches[1], slots, scale(ks), scale(vs))
    assert_fp8_equal(caches[0], ref[0])
    assert_fp8_equal(caches[1], ref[1])
    kept = slots >= 0
    stored = dequantize_kv_ref(ref[0].view(-1, hkv, d)[slots[kept]], scale(ks))
    want = k[kept].float().clamp(-448 * ks, 448 * ks)
    assert float((stored - want).abs().max()) <= 448 * ks / 16 + 1e-6  # within e4m3's relative step
    assert float(ref[0].view(-1, hkv, d)[slots[0]][0, 0].float()) == 448.0


# rows, hq, hkv, d, rotary_dim, gemma_norm, norm_offset, v_norm, k_eq_v
ROPE_CASES = [
    (3, 4, 2, 128, 64, False, 1.0, False, False),  # Llama / Qwen3, partial rotary
    (5, 16, 8, 256, 256, True, 0.0, True, False),  # Gemma 4 sliding
    (5, 16, 2, 512, 512, True, 0.0, True, True),  # Gemma 4 full: k_eq_v
]


@pytest.mark.parametrize("rows,hq,hkv,d,rd,gemma,offset,v_norm,k_eq_v", ROPE_CASES)
def test_fused_rope_kv_write_fp8_matches_twin(rows, hq, hkv, d, rd, gemma, offset, v_norm, k_eq_v):
    g = torch.Generator().manual_seed(rows + d)
    dtype = torch.bfloat16
    q = (3 * torch.randn(rows, hq, d, generator=g)).to(dtype).to(DEV)
    k = (3 * torch.randn(rows, hkv, d, generator=g)).to(dtype).to(DEV)
    v = None if k_eq_v else torch.randn(rows, hkv, d, generator=g).to(dtype).to(DEV)
    pos = torch.randint(0, 500, (rows,), generator=g).to(DEV)
    slots = torch.randperm(4 * 16, generator=g)[:rows]
    slots[rows // 2] = -1
    slots = slots.to(DEV)
    qw = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype).to(DEV)
    kw = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype).to(DEV)
    cos_sin = build_cos_sin_cache(rd, 512, 1e4).to(DEV)
    kc = torch.zeros(4, 16, hkv, d, device=DEV).to(FP8_KV_DTYPE)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    ks, vs = scale(0.011), scale(0.004)
    args = (q, k, v, pos, cos_sin, rd, qw, kw, 1e-6, gemma, v_norm, k_eq_v)
    q_ref, k_ref = qk_norm_rope_kv_write_ref(*args, kc, vc, slots, norm_offset=offset, k_scale=ks, v_scale=vs)
    with backend("triton"):
        q_out, k_out = qk_norm_rope_kv_write(*args, kc2, vc2, slots, norm_offset=offset, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(k_out, k_ref, atol=1 / 64, rtol=1 / 64)
    # the kernel stores exactly its own K rounded to e4m3 (its bf16 K may differ from the twin's by one ulp)
    written = slots >= 0
    want_k = quantize_kv_ref(k_out[written], FP8_KV_DTYPE, ks)
    assert_fp8_equal(kc2.view(-1, hkv, d)[slots[written]], want_k)
    # V: same stored values as the twin up to one e4m3 step where v-norm's bf16 rounding differs
    got_v = dequantize_kv_ref(vc2, vs)
    want_v = dequantize_kv_ref(vc, vs)
    torch.testing.assert_close(got_v, want_v, atol=448 * 0.004 / 16, rtol=1 / 8)
    assert float((vc2.view(torch.uint8) != vc.view(torch.uint8)).float().mean()) <= 0.02
    assert not vc2.view(-1, hkv, d)[slots[~written]].float().any()  # the padded row wrote nothing


# group, head dim, q dtype, k_scale, v_scale, window, soft cap
ATTN_CASES = [
    (1, 64, torch.float32, 0.02, 0.05, None, None),
    (2, 128, torch.bfloat16, 0.01, 0.3, None, None),
    (4, 64, torch.bfloat16, 1.0, 1.0, 16, 5.0),
    (4, 256, torch.bfloat16, 0.007, 0.02, None, None),
    (8, 512, torch.bfloat16, 0.015, 0.01, None, None),
]


@pytest.mark.parametrize("group,d,dtype,ks,vs,window,cap", ATTN_CASES)
def test_decode_fp8_matches_twin(group, d, dtype, ks, vs, window, cap):
    ctx = [1, 17, 33, 100] if d < 512 else [1, 40]
    batch = fp8_batch([1] * len(ctx), ctx, hq=2 * group, hkv=2, d=d, q_dtype=dtype, k_scale=ks, v_scale=vs)
    sc = dict(k_scale=scale(ks), v_scale=scale(vs))
    ref = paged_attention_ref(*batch, 1 / math.sqrt(d), window, cap, **sc)
    for splits in (None, 1, 3):
        out = paged_decode_attention(*batch, 1 / math.sqrt(d), window, cap, **sc, num_splits=splits)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("group,d,dtype,ks,vs,window,cap", ATTN_CASES)
def test_prefill_fp8_matches_twin(group, d, dtype, ks, vs, window, cap):
    q_lens, ctx = ([5, 1, 19, 40], [5, 30, 45, 40]) if d < 512 else ([3, 1, 9], [3, 20, 40])
    batch = fp8_batch(q_lens, ctx, hq=2 * group, hkv=2, d=d, q_dtype=dtype, k_scale=ks, v_scale=vs, seed=1)
    sc = dict(k_scale=scale(ks), v_scale=scale(vs))
    ref = paged_attention_ref(*batch, 1 / math.sqrt(d), window, cap, **sc)
    out = paged_prefill_attention(*batch, 1 / math.sqrt(d), window, cap, **sc)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_fp8_twin_is_close_to_the_unquantized_pool():
    """The twin's FP8 attention vs the same K / V unquantized (amax / 448 scales): e4m3's error (3 mantissa bits,
    relative step 1/8 .. 1/16), NMSE < 3e-3 (measured 1.2e-3 here)."""
    q, kc, vc, bt, sl, qsl = make_batch([1, 1], [50, 90], 8, 2, 128, 16, torch.float32, seed=3)
    ks, vs = scale(float(kc.abs().max()) / 448), scale(float(vc.abs().max()) / 448)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, 128**-0.5)
    got = paged_attention_ref(q, quantize_kv_ref(kc, FP8_KV_DTYPE, ks), quantize_kv_ref(vc, FP8_KV_DTYPE, vs), bt, sl,
                              qsl, 128**-0.5, k_scale=ks, v_scale=vs)
    assert float((got - want).pow(2).mean() / want.pow(2).mean()) < 3e-3


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_prefill_attention])
def test_wrong_scale_changes_the_kernel_output(fn):
    """The kernels read k_scale / v_scale: doubling either moves the output well past the tolerance (v_scale
    scales it exactly), and the right scales match the twin."""
    q_lens = [1, 1, 1] if fn is paged_decode_attention else [4, 1, 9]
    batch = fp8_batch(q_lens, [20, 33, 40], hq=4, hkv=2, d=64, q_dtype=torch.float32, k_scale=0.02, v_scale=0.03)
    right = fn(*batch, 0.125, k_scale=scale(0.02), v_scale=scale(0.03))
    torch.testing.assert_close(right, paged_attention_ref(*batch, 0.125, k_scale=scale(0.02), v_scale=scale(0.03)),
                               **TOL[torch.float32])
    wrong_k = fn(*batch, 0.125, k_scale=scale(0.04), v_scale=scale(0.03))
    wrong_v = fn(*batch, 0.125, k_scale=scale(0.02), v_scale=scale(0.06))
    assert float((wrong_k - right).abs().max()) > 0.05
    torch.testing.assert_close(wrong_v, 2 * right, atol=1e-4, rtol=1e-4)
    unit = fn(*batch, 0.125)  # no scales: 1.0
    assert float((unit - right).abs().max()) > 0.05
