"""Fused q/k RMSNorm + RoPE + paged K/V write: Triton (interpreter on CPU) against the torch twin, and the
twin / cos-sin table against transformers' Gemma 4 and Llama code.

Tolerances: fp32 atol = rtol = 1e-5; bf16 atol = rtol = 1/64 (the kernel's 1/sqrt and the twin's rsqrt
can round the normed value to neighbouring bf16 numbers: one ulp).
"""
from __future__ import annotations

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.norm_rope.rope import build_cos_sin_cache, qk_norm_rope_kv_write, qk_norm_rope_kv_write_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the small tests also run on a GPU machine
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1 / 64, rtol=1 / 64)}


def make(rows, hq, hkv, d, rotary_dim, dtype, k_eq_v, seed=0, page=16):
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(rows, hq, d, generator=g)).to(dtype)
    k = (3 * torch.randn(rows, hkv, d, generator=g)).to(dtype)
    v = None if k_eq_v else torch.randn(rows, hkv, d, generator=g).to(dtype)
    positions = torch.randint(0, 500, (rows,), generator=g)
    num_pages = 4 + 2 * (rows // page)
    slots = torch.randperm(num_pages * page, generator=g)[:rows]
    slots[rows // 2] = -1  # a padded row: not written
    qw = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    cache = build_cos_sin_cache(rotary_dim, 512, 1e4)
    k_cache = torch.zeros(num_pages, page, hkv, d, dtype=dtype)
    out = (q, k, v, positions, cache, qw, kw, k_cache, k_cache.clone(), slots)
    return tuple(None if t is None else t.to(DEV) for t in out)


# rows, hq, hkv, d, rotary_dim, dtype, gemma_norm, norm_offset, v_norm, k_eq_v, with q/k norm
CASES = [
    (1, 2, 1, 64, 64, torch.float32, False, 1.0, False, False, True),  # Llama / Qwen3
    (3, 4, 2, 128, 64, torch.bfloat16, False, 1.0, False, False, True),  # partial rotary, pass-through
    (17, 8, 2, 128, 128, torch.bfloat16, False, 1.0, False, False, False),  # plain RoPE, no norms
    (5, 4, 2, 256, 256, torch.bfloat16, True, 1.0, False, False, True),  # Gemma 3
    (5, 16, 8, 256, 256, torch.bfloat16, True, 0.0, True, False, True),  # Gemma 4 sliding
    (5, 16, 2, 512, 512, torch.bfloat16, True, 0.0, True, True, True),  # Gemma 4 full: k_eq_v
    (4, 2, 1, 96, 32, torch.float32, True, 0.0, True, True, True),  # odd head dim
]


@pytest.mark.parametrize("rows,hq,hkv,d,rd,dtype,gemma,offset,v_norm,k_eq_v,norms", CASES)
def test_kernel_matches_twin(rows, hq, hkv, d, rd, dtype, gemma, offset, v_norm, k_eq_v, norms):
    q, k, v, pos, cache, qw, kw, kc, vc, slots = make(rows, hq, hkv, d, rd, dtype, k_eq_v)
    if not norms:
        qw = kw = None
    args = (q, k, v, pos, cache, rd, qw, kw, 1e-6, gemma, v_norm, k_eq_v)
    kc2, vc2 = kc.clone(), vc.clone()
    want = qk_norm_rope_kv_write_ref(*args, kc, vc, slots, norm_offset=offset)
    with backend("triton"):
        got = qk_norm_rope_kv_write(*args, kc2, vc2, slots, norm_offset=offset)
    for a, b in zip(got + (kc2, vc2), want + (kc, vc)):
        torch.testing.assert_close(a, b, **TOL[dtype])
    flat, slots = kc2.view(-1, hkv, d).cpu(), slots.cpu()
    assert flat[slots[slots >= 0]].abs().sum(-1).gt(0).all()  # written rows
    assert int((flat.abs().sum((-1, -2)) > 0).sum()) == int((slots >= 0).sum())  # and nothing else


def test_twin_matches_transformers_gemma4():
    """Gemma 4 full layer (proportional RoPE, k_eq_v, scale-free v-norm) and sliding layer, fp32, vs HF."""
    from transformers.models.gemma4 import modeling_gemma4 as hf
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    cfg = Gemma4TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           global_head_dim=64, num_hidden_layers=2, vocab_size=64, intermediate_size=32,
                           layer_types=["sliding_attention", "full_attention"])
    rot = hf.Gemma4TextRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 1, 7, 300])
    for layer_type, d, cache in (
        ("sliding_attention", 32, build_cos_sin_cache(32, 512, 1e4)),
        ("full_attention", 64, build_cos_sin_cache(64, 512, 1e6, freq_dim=64, rotated_pairs=int(0.25 * 64 // 2))),
    ):
        q = torch.randn(4, 4, d, generator=g)
        k = torch.randn(4, 2, d, generator=g)
        qn, kn, vn = hf.Gemma4RMSNorm(d), hf.Gemma4RMSNorm(d), hf.Gemma4RMSNorm(d, with_scale=False)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(d, generator=g))
            kn.weight.copy_(torch.randn(d, generator=g))
        cos, sin = rot(q, pos[None], layer_type)
        want_q = hf.apply_rotary_pos_emb(qn(q)[None], cos, sin, unsqueeze_dim=2)[0]
        want_k = hf.apply_rotary_pos_emb(kn(k)[None], cos, sin, unsqueeze_dim=2)[0]
        kc = torch.zeros(1, 16, 2, d)
        vc = torch.zeros(1, 16, 2, d)
        got_q, got_k = qk_norm_rope_kv_write_ref(
            q, k, None, pos, cache, d, qn.weight.detach(), kn.weight.detach(), cfg.rms_norm_eps, True, True, True,
            kc, vc, torch.arange(4), norm_offset=0.0,
        )
        torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kc[0, :4], want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc[0, :4], vn(k).detach(), atol=1e-5, rtol=1e-5)


def test_twin_matches_transformers_llama_partial():
    """GPT-NeoX-style partial rotary (first RD dims, inv_freq over RD) and LlamaRMSNorm-style weight."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d, rd = 64, 32
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, d, generator=g)
    pos = torch.tensor([5, 0, 99])
    inv = 1.0 / (1e4 ** (torch.arange(0, rd, 2).float() / rd))
    freqs = pos[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    qr, qp = q[..., :rd], q[..., rd:]  # [R, H, RD]: cos [R, RD] broadcasts over heads with unsqueeze_dim=1
    want = torch.cat([apply_rotary_pos_emb(qr, qr, emb.cos(), emb.sin(), unsqueeze_dim=1)[0], qp], -1)
    kc = vc = torch.zeros(1, 16, 2, d)
    got, _ = qk_norm_rope_kv_write_ref(q, q, q, pos, build_cos_sin_cache(rd, 128, 1e4), rd, None, None, 1e-6,
                                       False, False, False, kc, vc.clone(), torch.full((3,), -1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments():
    q, k, v, pos, cache, qw, kw, kc, vc, slots = make(3, 2, 1, 64, 64, torch.float32, False)
    with pytest.raises(ValueError, match="k_eq_v"):
        qk_norm_rope_kv_write(q, k, None, pos, cache, 64, qw, kw, 1e-6, False, False, False, kc, vc, slots)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope_kv_write(q, k, v, pos, cache, 32, qw, kw, 1e-6, False, False, False, kc, vc, slots)
    with pytest.raises(ValueError, match="int64"):
        qk_norm_rope_kv_write(q, k, v, pos.int(), cache, 64, qw, kw, 1e-6, False, False, False, kc, vc, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hkv,k_eq_v", [(256, 8, False), (512, 2, True)])
def test_gemma4_shapes_gpu(d, hkv, k_eq_v):
    rows = 257
    q, k, v, pos, _, qw, kw, _, _, _ = make(rows, 16, hkv, d, d, torch.bfloat16, k_eq_v)
    cache = build_cos_sin_cache(d, 512, 1e6, freq_dim=d, rotated_pairs=d // 8).cuda()
    kc = torch.zeros(40, 16, hkv, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.randperm(640)[:rows].cuda()
    args = (q, k, v, pos, cache, d, qw, kw, 1e-6, True, True, k_eq_v)
    kc2, vc2 = kc.clone(), vc.clone()
    want = qk_norm_rope_kv_write_ref(*args, kc, vc, slots, norm_offset=0.0)
    got = qk_norm_rope_kv_write(*args, kc2, vc2, slots, norm_offset=0.0)
    for a, b in zip(got + (kc2, vc2), want + (kc, vc)):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
