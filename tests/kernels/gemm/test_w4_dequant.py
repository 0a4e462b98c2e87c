"""The 4-bit weights' dequantize kernel (``int4.w4_dequantize``) against the formats' torch twins, bit for bit, and
the prefill paths built on it (``int4.DEQUANT_MIN_ROWS``: dequantize then F.linear; ``int4_moe.DEQUANT_MIN_ROWS``:
every expert dequantized, then the float grouped path) against the twins. CPU: TRITON_INTERPRET=1 at tiny shapes
(tests/conftest.py); GPU-marked tests at the Gemma 4 26B-A4B shapes.

Budgets: the dequantized weights equal the twins' exactly (same fp32 operations, one rounding to the output
dtype). The linears then multiply in x's dtype (the twin: int4 on CUDA the same F.linear; on the CPU in fp32), and
NVFP4 folds its global multiplier into the weight (one more bf16 rounding of each weight than the twin, 2^-9
relative): fp32 atol 1e-4, bf16 NMSE <= 1e-5. The experts: as tests/kernels/gemm/test_int4_kernels.py (NMSE <= 1e-4
in bf16: the intermediate [P, I] rounded once more on one side)."""
from __future__ import annotations

import pytest
import torch

from sparrow.kernels import backend

from sparrow.kernels.gemm import int4 as int4_mod

from sparrow.kernels.moe import int4_moe
from sparrow.kernels.gemm.int4 import dequantize_int4_ref, int4_linear, int4_linear_ref, quantize_int4_ref, w4_dequantize
from sparrow.kernels.moe.int4_moe import int4_fused_moe, int4_fused_moe_ref
from sparrow.kernels.gemm.nvfp4 import dequantize_nvfp4_ref, quantize_nvfp4_ref
from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear, nvfp4_linear_w4a16_ref
from sparrow.kernels.moe.nvfp4_moe import dequantize_nvfp4_experts, nvfp4_fused_moe, nvfp4_fused_moe_ref
from tests.helpers import nmse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 1e-4
BF16_NMSE = 1e-5
MOE_BF16_NMSE = 1e-4


def _int4(shape, group, symmetric, scale_dtype, seed=0, device=DEVICE):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    return quantize_int4_ref(w.to(device), group, symmetric, scale_dtype)


def _nvfp4(n, k, seed=0, convention="modelopt", device=DEVICE):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    codes, scale, g = quantize_nvfp4_ref(w, convention)
    gvec = g.reshape(1).expand(n).clone()
    gvec[: n // 2] *= 0.5  # two shards with different global scales
    return codes.to(device), scale.to(device), gvec.to(device)


def _words(codes):
    return codes.contiguous().view(torch.int32)


@pytest.mark.parametrize("group,symmetric,scale_dtype,dtype", [
    (32, True, torch.bfloat16, torch.bfloat16), (64, False, torch.float32, torch.float32),
    (128, False, torch.float16, torch.bfloat16), (128, True, torch.bfloat16, torch.float32)])
def test_int4_dequantize_equals_twin(group, symmetric, scale_dtype, dtype):
    """One weight (K = 320: a tail group of 64 past the last full 128) and stacked experts [3, 40, 256]."""
    for shape in ((40, 320), (3, 40, 256)):
        packed, scale, zero = _int4(shape, group, symmetric, scale_dtype)
        with backend("triton"):
            got = w4_dequantize(packed, scale, zero, None, group, dtype)
        want = dequantize_int4_ref(packed, scale, zero, group).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("divide_global,dtype", [(False, torch.bfloat16), (True, torch.float32),
                                                  (False, torch.float16)])
def test_nvfp4_dequantize_equals_twin(divide_global, dtype):
    """Per-row globals of one weight (g_rows 1) and per-(expert, half) globals of stacked gate|up experts."""
    codes, scale, g = _nvfp4(48, 160)
    with backend("triton"):
        got = w4_dequantize(_words(codes), scale, None, g, 16, dtype, 1, divide_global)
    assert torch.equal(got, dequantize_nvfp4_ref(codes, scale, g, divide_global).to(dtype))
    e, i, h = 3, 16, 96
    parts = [_nvfp4(i, h, seed) for seed in range(2 * e)]  # one global per (expert, half)
    codes = torch.stack([torch.cat([parts[2 * x][0], parts[2 * x + 1][0]]) for x in range(e)])
    scale = torch.stack([torch.cat([parts[2 * x][1], parts[2 * x + 1][1]]) for x in range(e)])
    glob = torch.stack([torch.stack([parts[2 * x][2][:1], parts[2 * x + 1][2][:1]]) for x in range(e)])  # [E, 2, 1]
    with backend("triton"):
        got = w4_dequantize(_words(codes), scale, None, glob.reshape(e, 2).contiguous(), 16, dtype, i, divide_global)
    assert torch.equal(got, dequantize_nvfp4_experts(codes, scale, glob, divide_global).to(dtype))


def test_dequantize_bad_group():
    packed, scale, zero = _int4((8, 64), 32, True, torch.float32)
    with pytest.raises(ValueError, match="group"):
        w4_dequantize(packed, scale, zero, None, 4, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_from_dequant_rows(monkeypatch, dtype):
    """int4_linear / nvfp4_linear at and above DEQUANT_MIN_ROWS (set to 5 here) take the dequantize path; below it
    the kernel: both against the twins."""
    monkeypatch.setattr(int4_mod, "DEQUANT_MIN_ROWS", 5)
    packed, scale, zero = _int4((40, 192), 64, False, torch.float32 if dtype == torch.float32 else torch.bfloat16)
    codes, nscale, g = _nvfp4(40, 192)
    for rows in (4, 5, 9):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
        with backend("triton"):
            got = int4_linear(x, packed, scale, zero, 64), nvfp4_linear(x, codes, nscale, g)
        want = int4_linear_ref(x, packed, scale, zero, 64), nvfp4_linear_w4a16_ref(x, codes, nscale, g)
        for a, b in zip(got, want):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=0)
            else:
                assert a.dtype == dtype and nmse(a, b) <= BF16_NMSE


def _routing(rows, h, e, k, dtype, device=DEVICE):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, h, generator=gen).to(dtype).to(device)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(rows)]).to(device)
    wts = torch.softmax(torch.randn(rows, k, generator=gen), -1).to(device)
    return x, wts, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_from_dequant_rows(monkeypatch, dtype):
    """int4 and NVFP4 experts on the grouped path from int4_moe.DEQUANT_MIN_ROWS rows (set to 1): every expert
    dequantized, the float kernels; against the twins."""
    monkeypatch.setattr(int4_moe, "DEQUANT_MIN_ROWS", 1)
    e, h, i, k = 4, 64, 32, 2
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    w13 = _int4((e, 2 * i, h), 32, False, scale_dtype, 1)
    w2 = _int4((e, h, i), 32, False, scale_dtype, 2)
    codes13, s13, g13 = (torch.stack(t) for t in zip(*[_nvfp4(2 * i, h, 10 + x) for x in range(e)]))
    codes2, s2, g2 = (torch.stack(t) for t in zip(*[_nvfp4(h, i, 20 + x) for x in range(e)]))
    glob13, glob2 = g13[:, [0, -1]].reshape(e, 2, 1).contiguous(), g2[:, :1].reshape(e, 1, 1).contiguous()
    nv = (codes13, s13, glob13, codes2, s2, glob2)
    x, wts, ids = _routing(9, h, e, k, dtype)
    want = (int4_fused_moe_ref(x, *w13, *w2, 32, wts, ids, "silu", pair_threshold=0),
            nvfp4_fused_moe_ref(x, *nv, wts, ids, "silu", pair_threshold=0))
    with backend("triton"):
        got = (int4_fused_moe(x, *w13, *w2, 32, wts, ids, "silu", pair_threshold=0),
               nvfp4_fused_moe(x, *nv, wts, ids, "silu", pair_threshold=0))
    for a, b in zip(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=0)
        else:
            assert a.dtype == dtype and nmse(a, b) <= MOE_BF16_NMSE


@pytest.mark.gpu
def test_dequant_paths_gpu(monkeypatch):
    """Gemma 4 26B-A4B shapes in bf16 on the GPU: the dequantized weights equal the twins', the prefill paths
    (2,048 rows) match the fp32 twins."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    packed, scale, zero = _int4((4096, 2816), 128, True, torch.bfloat16, device="cuda")
    assert torch.equal(w4_dequantize(packed, scale, zero, None, 128, torch.bfloat16),
                       dequantize_int4_ref(packed, scale, zero, 128).to(torch.bfloat16))
    monkeypatch.setattr(int4_mod, "DEQUANT_MIN_ROWS", 1024)
    monkeypatch.setattr(int4_moe, "DEQUANT_MIN_ROWS", 1024)
    x = torch.randn(2048, 2816, device="cuda").bfloat16()
    assert nmse(int4_linear(x, packed, scale, zero, 128),
                int4_linear_ref(x.float(), packed, scale.float(), None, 128)) <= BF16_NMSE
    e, h, i = 128, 2816, 704
    w13 = _int4((e, 2 * i, h), 128, True, torch.bfloat16, 1, "cuda")
    w2 = _int4((e, h, i), 128, True, torch.bfloat16, 2, "cuda")
    x, wts, ids = _routing(2048, h, e, 8, torch.bfloat16, "cuda")
    got = int4_fused_moe(x, *w13, *w2, 128, wts, ids, "gelu_pytorch_tanh")
    with backend("torch"):
        want = int4_fused_moe_ref(x.float(), *w13, *w2, 128, wts, ids, "gelu_pytorch_tanh")
    assert nmse(got, want) <= MOE_BF16_NMSE
