"""NVFP4 linear kernel (W4A16 and W4A8) against its torch twins (sparrow.kernels.nvfp4_linear).

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at tiny shapes; the GPU-marked test runs
the H200 shapes. Weights are quantized by ``quantize_nvfp4_ref`` (ModelOpt's formula); outputs are ~N(0, 1).
NMSE budgets (||y - twin||^2 / ||twin||^2): fp32 1e-10 (exact products, only the summation order differs);
bf16 1e-4 (one output rounding, 2^-8 relative, squared ~1.5e-5 plus the kernel's fp32 order). W4A8 against
its own twin: 1e-4 fp32 (e4m3 rounding of a value at a halfway point may go the other way after a different
division order: rare, one element of 16 moved by 2^-4 relative), against the W4A16 twin 2e-3 (e4m3 on
activations, 2^-4 relative per element, averaged over K).
"""
import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.nvfp4 import quantize_nvfp4_ref
from sparrow.kernels.nvfp4_linear import (
    nvfp4_linear,
    nvfp4_linear_triton,
    nvfp4_linear_w4a8_ref,
    nvfp4_linear_w4a16_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUDGET = {torch.float32: 1e-10, torch.bfloat16: 1e-4}


def _nmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).sum() / (b ** 2).sum().clamp_min(1e-30))


def _layer(n: int, k: int, seed: int = 0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    codes, scale, g2 = quantize_nvfp4_ref(w)
    gvec = g2.expand(n).clone()
    gvec[: n // 2] *= 0.5  # two shards with different global scales
    return codes.to(device), scale.to(device), gvec.to(device)


def _x(rows: int, k: int, dtype, seed: int = 1, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_matches_twin(rows, dtype):
    codes, scale, g = _layer(72, 96)  # N ragged against the 64-wide tile
    x = _x(rows, 96, dtype)
    y = nvfp4_linear_triton(x, codes, scale, g)
    assert y.dtype == dtype and y.shape == (rows, 72)
    assert _nmse(y, nvfp4_linear_w4a16_ref(x, codes, scale, g)) < BUDGET[dtype]


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_w4a8_matches_twin(rows):
    codes, scale, g = _layer(40, 64, seed=2)
    x = _x(rows, 64, torch.float32, seed=3)
    y = nvfp4_linear_triton(x, codes, scale, g, w4a8=True)
    assert _nmse(y, nvfp4_linear_w4a8_ref(x, codes, scale, g)) < 1e-4
    assert _nmse(y, nvfp4_linear_w4a16_ref(x, codes, scale, g)) < 2e-3


def test_dispatch_and_errors():
    codes, scale, g = _layer(16, 48, device="cpu")  # K = 48: not a multiple of 32 -> the twin
    x = _x(2, 48, torch.float32, device="cpu")
    with backend("triton"):
        assert torch.equal(nvfp4_linear(x, codes, scale, g), nvfp4_linear_w4a16_ref(x, codes, scale, g))
        with pytest.raises(ValueError, match="not a multiple of 32"):
            nvfp4_linear_triton(x, codes, scale, g)
    with pytest.raises(ValueError, match="codes uint8"):
        nvfp4_linear(x, codes.to(torch.int8), scale, g)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 64, 65, 1024])
@pytest.mark.parametrize("w4a8", [False, True])
def test_gpu_shapes(rows, w4a8):
    """gemma4-26b-a4b's dense shapes (K x N): 2816 x 4096 (q), 4096 x 2816 (o), 2816 x 4224, 2112 x 2816."""
    for k, n in ((2816, 4096), (4096, 2816), (2816, 4224), (2112, 2816)):
        codes, scale, g = _layer(n, k)
        x = _x(rows, k, torch.bfloat16)
        y = nvfp4_linear_triton(x, codes, scale, g, w4a8=w4a8)
        twin = (nvfp4_linear_w4a8_ref if w4a8 else nvfp4_linear_w4a16_ref)(x, codes, scale, g)
        assert _nmse(y, twin) < (1e-3 if w4a8 else 1e-4), (k, n)
