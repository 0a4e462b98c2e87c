"""Block-scaled FP8 GEMM (``sparrow.kernels.gemm.fp8_gemm``) vs its torch twin.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; GPU tests
(real layer shapes) are marked ``gpu``. Tolerance: the kernel and the twin quantize the activations with
the same formula, so they differ only by fp32 summation order (and the final rounding to x's dtype):
fp32 outputs atol = rtol = 1e-4 (outputs are O(10)); bf16 outputs NMSE <= 5e-5 (a bf16 ulp is 2^-8 relative: a few outputs rounding to the
neighbouring bf16 value after a different summation order cost ~1e-5).
Run as a script on a GPU for TFLOP/s at the flagship shapes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
from sparrow.kernels.gemm.fp8_gemm import (
    FP8_GEMM_CONFIGS,
    Fp8GemmConfig,
    fp8_gemm,
    fp8_gemm_ref,
    fp8_gemm_triton,
    forced_config,
    pick_config,
)
from tests.helpers import nmse

ROWS = [1, 2, 3, 16, 17, 33, 65]
SHAPES = [(128, 128), (130, 200), (257, 384)]  # (N, K): one block, ragged N and K, several blocks
CONFIGS = [Fp8GemmConfig(block_m=16, block_n=32, group_m=2), Fp8GemmConfig(block_m=32, block_n=64, group_m=1),
           Fp8GemmConfig(block_m=16, block_n=32, group_m=1, split_k=2)]  # split-K: 1-3 K groups over 2 programs


def _operands(m, n, k, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    # uneven magnitudes across blocks so the per-block scales matter
    w *= torch.linspace(0.2, 3.0, n)[:, None]
    wq, ws = quantize_fp8_block_ref(w.to(device))
    return x, wq, ws


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", CONFIGS, ids=["m16n32", "m32n64", "m16n32_split2"])
def test_triton_matches_twin_fp32(rows, n, k, config):
    x, wq, ws = _operands(rows, n, k, seed=rows + n)
    with forced_config(config):
        y = fp8_gemm_triton(x, wq, ws)
    torch.testing.assert_close(y, fp8_gemm_ref(x, wq, ws), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [3, 17])
def test_triton_matches_twin_bf16(rows):
    x, wq, ws = _operands(rows, 257, 384, seed=7, dtype=torch.bfloat16)
    with forced_config(CONFIGS[0]):
        y = fp8_gemm_triton(x, wq, ws)
    assert y.dtype == torch.bfloat16
    assert nmse(y, fp8_gemm_ref(x, wq, ws)) <= 5e-5


def test_twin_is_close_to_unquantized():
    """W8A8 vs the float product: NMSE ~1e-3 (e4m3 keeps 3 mantissa bits on both operands); budget 5e-3."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 384, generator=g), torch.randn(256, 384, generator=g) * 0.05
    wq, ws = quantize_fp8_block_ref(w)
    assert nmse(fp8_gemm_ref(x, wq, ws), x @ w.T) <= 5e-3


def test_table_and_dispatch():
    assert pick_config(1) == FP8_GEMM_CONFIGS[0][1]
    assert pick_config(10**6).block_m == 128
    x, wq, ws = _operands(5, 128, 128)
    torch.testing.assert_close(fp8_gemm(x, wq, ws), fp8_gemm_ref(x, wq, ws))  # CPU tensors -> twin


def test_empty_and_bad_inputs():
    x, wq, ws = _operands(4, 128, 128)
    assert fp8_gemm_triton(x[:0], wq, ws).shape == (0, 128)
    bad = [
        lambda: fp8_gemm_ref(x, wq.float(), ws),  # weight not e4m3
        lambda: fp8_gemm_ref(x, wq, ws[:, :0]),  # scale shape
        lambda: fp8_gemm_ref(x, wq, ws.double()),  # scale dtype
        lambda: fp8_gemm_ref(x[:, :100], wq, ws),  # K mismatch
        lambda: fp8_gemm_ref(x.to(torch.float8_e4m3fn), wq, ws),  # e4m3 x: the kernel quantizes float x
        lambda: fp8_gemm_ref(x, wq, ws, torch.int32),  # out_dtype
        lambda: fp8_gemm_triton(x.t(), wq, ws),  # shape / stride
    ]
    for call in bad:
        with pytest.raises(ValueError, match="fp8_gemm"):
            call()


# ---- GPU: real shapes ----------------------------------------------------------------------------------

GPU_SHAPES = [(2816, 4096), (4096, 2816), (1408, 2816), (2816, 704), (704 * 2, 2816)]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4, 0])
@pytest.mark.parametrize("rows", [17, 64, 65, 257, 1024, 2048])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(rows, n, k, split):
    x, wq, ws = _operands(rows, n, k, seed=rows, device="cuda", dtype=torch.bfloat16)
    with forced_config(dataclasses.replace(pick_config(rows), split_k=split)):
        y = fp8_gemm_triton(x, wq, ws)
    assert nmse(y, fp8_gemm_ref(x, wq, ws)) <= 5e-5


def _bench(rows, n, k, iters=50):  # pragma: no cover - GPU script
    x, wq, ws = _operands(rows, n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fp8_gemm_triton(x, wq, ws)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fp8_gemm_triton(x, wq, ws)
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / iters / 1e3
    flops = 2 * rows * n * k / sec / 1e12
    gbs = (n * k + rows * k * 2 + rows * n * 2) / sec / 1e9
    print(f"M={rows:5d} N={n:5d} K={k:5d}: {sec * 1e6:8.1f} us  {flops:7.1f} TFLOP/s "
          f"({100 * flops / 1979:.0f}% of H200 dense fp8 1979)  {gbs:7.1f} GB/s")


if __name__ == "__main__":  # pragma: no cover
    for n, k in GPU_SHAPES:
        for rows in (17, 64, 256, 2048, 8192):
            _bench(rows, n, k)
