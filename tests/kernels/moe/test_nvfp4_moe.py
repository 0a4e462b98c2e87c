"""NVFP4 routed experts (``sparrow.kernels.moe.nvfp4_moe``): the W4A16 Triton kernels (small per-pair path and grouped
path) against the torch twin (the selected experts dequantized by ``dequantize_nvfp4_ref``, the float paths of
``moe_ref``). CPU: TRITON_INTERPRET=1 at tiny shapes (tests/conftest.py); the GPU-marked test at gemma4's shape.

Budgets: fp32 activations: both sides multiply exact e2m1 * e4m3 products and apply the global scale in fp32
(the twin per weight, the kernel on the sums), differing in rounding order only (atol 1e-4 on outputs of ~0.1).
bf16: the twin rounds each weight e2m1 * scale * global to bf16 (2^-9 relative) and gate|up to bf16 before the
activation, the kernel keeps the exact products and fp32 sums, so the NMSE is a few bf16 roundings (<= 1e-4, as
the int4 experts' budget)."""
from __future__ import annotations

import functools

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref
from sparrow.kernels.moe.nvfp4_moe import nvfp4_fused_moe, nvfp4_fused_moe_ref
from tests.helpers import nmse

FP32_ATOL = 1e-4
BF16_NMSE = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=2)
def _experts(e, h, i, convention, device):
    """Stacked NVFP4 experts, one global scale per projection (gate, up, down) as a per-expert export has."""
    g = torch.Generator().manual_seed(e * 7 + h)
    out = []
    for rows, k, blocks in ((2 * i, h, 2), (h, i, 1)):
        w = torch.randn(e, rows, k, generator=g) / k ** 0.5
        parts = [[quantize_nvfp4_ref(w[x, b * rows // blocks:(b + 1) * rows // blocks], convention)
                  for b in range(blocks)] for x in range(e)]
        codes = torch.stack([torch.cat([p[0] for p in ps]) for ps in parts])
        scale = torch.stack([torch.cat([p[1] for p in ps]) for ps in parts])
        glob = torch.stack([torch.stack([p[2] for p in ps]) for ps in parts])  # [E, blocks, 1]
        out += [codes.to(device), scale.to(device), glob.to(device)]
    return tuple(out)


def _case(rows, e, h, i, k, dtype, convention="modelopt", device=DEVICE):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, h, generator=g).to(dtype).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).to(device)
    wts = torch.softmax(torch.randn(rows, k, generator=g), -1).to(device)
    return x, _experts(e, h, i, convention, device), wts, ids


def _check(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
    else:
        assert nmse(got, want) <= BF16_NMSE


@pytest.mark.parametrize("rows", (1, 2, 3, 16, 17))
@pytest.mark.parametrize("dtype,convention", [(torch.float32, "compressed-tensors"), (torch.bfloat16, "modelopt")])
def test_nvfp4_moe_interpreter(rows, dtype, convention):
    """Small path (P <= pair_threshold) and grouped path (threshold 0): the Triton kernels vs the twin."""
    x, w, wts, ids = _case(rows, 4, 64, 32, 2, dtype, convention)
    divide = convention == "compressed-tensors"
    for threshold in (64, 0):
        want = nvfp4_fused_moe_ref(x, *w, wts, ids, "silu", divide_global=divide, pair_threshold=threshold)
        with backend("triton"):
            got = nvfp4_fused_moe(x, *w, wts, ids, "silu", divide_global=divide, pair_threshold=threshold)
        _check(got, want, dtype)


def test_nvfp4_fp16_interpreter():
    """fp16 activations (the kernels scale the weight tile differently: fp16 cannot hold the bf16 path's 2^-62
    scaled values): the experts on both paths and the dense linear, 3 rows."""
    from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear_triton, nvfp4_linear_w4a16_ref

    x, w, wts, ids = _case(3, 4, 64, 32, 2, torch.float16)
    for threshold in (64, 0):
        want = nvfp4_fused_moe_ref(x, *w, wts, ids, "silu", pair_threshold=threshold)
        with backend("triton"):
            got = nvfp4_fused_moe(x, *w, wts, ids, "silu", pair_threshold=threshold)
        assert nmse(got, want) <= BF16_NMSE
    codes, scale, g = w[0][0], w[1][0], w[2][0].repeat_interleave(32, 0).reshape(-1).contiguous()
    y = nvfp4_linear_triton(x, codes, scale, g)
    assert nmse(y, nvfp4_linear_w4a16_ref(x, codes, scale, g)) <= BF16_NMSE


def test_nvfp4_moe_bad_input():
    x, w, wts, ids = _case(1, 4, 64, 32, 2, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="w13_scale must be e4m3"):
        nvfp4_fused_moe(x, w[0], w[1].float(), *w[2:], wts, ids)
    with pytest.raises(ValueError, match="do not fit"):
        nvfp4_fused_moe(x[:, :48], *w, wts, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 2, 3, 16, 17, 64, 65, 1024))
def test_nvfp4_moe_gpu(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, wts, ids = _case(rows, 128, 2816, 704, 8, torch.bfloat16, device="cuda")
    got = nvfp4_fused_moe(x, *w, wts, ids, "gelu_pytorch_tanh")
    with backend("torch"):
        want = nvfp4_fused_moe_ref(x.float(), *w, wts, ids, "gelu_pytorch_tanh")
    assert nmse(got, want) <= BF16_NMSE
