"""NVFP4 linear kernel (W4A16) against its torch twin (sparrow.kernels.gemm.nvfp4_linear).

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at tiny shapes; the GPU-marked test runs
the H200 shapes. Weights are quantized by ``quantize_nvfp4_ref`` (ModelOpt's formula); outputs are ~N(0, 1).
NMSE budgets (||y - twin||^2 / ||twin||^2): fp32 1e-10 (exact products, only the summation order differs);
bf16 1e-4 (one output rounding, 2^-8 relative, squared ~1.5e-5 plus the kernel's fp32 order).
"""
import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref
from sparrow.kernels.gemm.nvfp4_linear import (
    nvfp4_linear,
    nvfp4_linear_triton,
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


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 64, 65])  # GEMV, <= 64 and GEMM tiles (int4.INT4_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_matches_twin(rows, dtype):
    codes, scale, g = _layer(72, 96)  # N ragged against the 64-wide tile
    x = _x(rows, 96, dtype)
    y = nvfp4_linear_triton(x, codes, scale, g)
    assert y.dtype == dtype and y.shape == (rows, 72)
    assert _nmse(y, nvfp4_linear_w4a16_ref(x, codes, scale, g)) < BUDGET[dtype]


@pytest.mark.parametrize("rows", [1, 17, 65])
def test_k_tail_matches_twin(rows):
    """K = 48: one whole 16-column group past the last 32, a masked tail step of the kernel; rows past the
    GEMV bound too."""
    codes, scale, g = _layer(40, 48, seed=2)
    x = _x(rows, 48, torch.float32, seed=3)
    assert _nmse(nvfp4_linear_triton(x, codes, scale, g), nvfp4_linear_w4a16_ref(x, codes, scale, g)) < 1e-10


def test_dispatch_and_errors():
    codes, scale, g = _layer(16, 64, device="cpu")
    x = _x(2, 64, torch.float32, device="cpu")
    with backend("torch"):
        assert torch.equal(nvfp4_linear(x, codes, scale, g), nvfp4_linear_w4a16_ref(x, codes, scale, g))
    with backend("triton"):
        assert _nmse(nvfp4_linear(x, codes, scale, g), nvfp4_linear_w4a16_ref(x, codes, scale, g)) < 1e-10
        with pytest.raises(ValueError, match="K = 56 is not a multiple of 16"):
            nvfp4_linear(_x(2, 56, torch.float32, device="cpu"), codes[:, :28], scale[:, :3], g)
    with pytest.raises(ValueError, match="codes uint8"):
        nvfp4_linear(x, codes.to(torch.int8), scale, g)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 64, 65, 1024])
def test_gpu_shapes(rows):
    """gemma4-26b-a4b's dense shapes (K x N): 2816 x 4096 (q), 4096 x 2816 (o), 2816 x 4224, 2112 x 2816; and
    2064 x 1000 (K an odd number of 16-column groups, N ragged)."""
    for k, n in ((2816, 4096), (4096, 2816), (2816, 4224), (2112, 2816), (2064, 1000)):
        codes, scale, g = _layer(n, k)
        x = _x(rows, k, torch.bfloat16)
        y = nvfp4_linear_triton(x, codes, scale, g)
        assert _nmse(y, nvfp4_linear_w4a16_ref(x, codes, scale, g)) < 1e-4, (k, n)
