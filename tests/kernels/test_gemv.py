"""Small-row GEMV: the Triton launchers against their torch twins.

Shapes: R = rows (<= 16), K = input width, N = output width. On CPU the kernel runs under
TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small. Run as a script on a GPU for GB/s.
"""
import os

import numpy as np
import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.fp8 import quantize_fp8_block_ref
from sparrow.kernels.gemv import (
    GemvConfig,
    forced_config,
    gemv,
    gemv_fp8,
    gemv_fp8_ref,
    gemv_fp8_triton,
    gemv_ref,
    gemv_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 16]
SHAPES = [(40, 136), (136, 40), (1000, 72), (200, 1000)]  # (K, N): odd, ragged against every tile
DTYPES = [torch.float32, torch.bfloat16]
# Outputs are ~N(0, 1). fp32: exact products, only the summation order differs over K <= 1000 terms;
# bf16: the same plus one output rounding (<= 2^-8 relative).
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
CONFIGS = {
    "default": None,
    "fma": GemvConfig(block_n=32, block_k=128, use_dot=False),
    "dot": GemvConfig(block_n=32, block_k=64, use_dot=True),
    "dot_wide_k": GemvConfig(block_n=16, block_k=256, use_dot=True),  # FP8: two 128-wide scale blocks a step
    "swap_ab": GemvConfig(block_n=32, block_k=256, use_dot=True, swap_ab=True),  # weight as the dot's A side
}


@pytest.fixture(scope="module", autouse=True)
def interpreter_bf16_dot():
    """Triton 3.9's interpreter feeds bf16 tl.dot operands to numpy as their raw uint16 bits. While this
    module runs, widen bf16 operands to fp32 first (exact), as the GPU's bf16 MMA does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << 16
        return ti.TensorHandle(bits.view(np.float32), tl.float32)

    builder.create_dot = lambda self, a, b, d, *rest: create_dot(self, widen(a), widen(b), d, *rest)
    yield
    builder.create_dot = create_dot


def _inputs(rows, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    return x, w


def _run(config_name, fn, *args):
    config = CONFIGS[config_name]
    if config is None:
        return fn(*args)
    with forced_config(config):
        return fn(*args)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_gemv_matches_twin(rows, k, n, dtype, config):
    x, w = _inputs(rows, k, n, dtype)
    torch.testing.assert_close(_run(config, gemv_triton, x, w), gemv_ref(x, w), **TOL[dtype])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", [1, 16])
def test_gemv_fp8_matches_twin(rows, k, n, dtype, config):
    x, w = _inputs(rows, k, n, dtype)
    wq, ws = quantize_fp8_block_ref(w)
    torch.testing.assert_close(_run(config, gemv_fp8_triton, x, wq, ws), gemv_fp8_ref(x, wq, ws), **TOL[dtype])


A8_CONFIGS = {
    "a8": GemvConfig(block_n=32, block_k=128, use_dot=True, a8=True),
    "a8_swap_ab": GemvConfig(block_n=64, block_k=256, use_dot=True, swap_ab=True, a8=True),
}


@pytest.mark.parametrize("config", list(A8_CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemv_fp8_a8_matches_w8a8_twin(rows, k, n, dtype, config):
    """The W8A8 variant quantizes x per 128-group like fp8_gemm: its twin is fp8_gemm_ref, ragged K included."""
    from sparrow.kernels.fp8_gemm import fp8_gemm_ref

    x, w = _inputs(rows, k, n, dtype)
    wq, ws = quantize_fp8_block_ref(w)
    with forced_config(A8_CONFIGS[config]):
        got = gemv_fp8_triton(x, wq, ws)
    torch.testing.assert_close(got, fp8_gemm_ref(x, wq, ws), **TOL[dtype])


def test_gemv_fp8_a8_needs_whole_scale_groups():
    x, w = _inputs(2, 256, 32, torch.float32)
    wq, ws = quantize_fp8_block_ref(w)
    with forced_config(GemvConfig(block_n=32, block_k=64, use_dot=True, a8=True)):
        with pytest.raises(ValueError, match="W8A8"):
            gemv_fp8_triton(x, wq, ws)


def test_fp8_twin_is_close_to_unquantized():
    x, w = _inputs(3, 1000, 264, torch.float32)
    wq, ws = quantize_fp8_block_ref(w)
    err = gemv_fp8_ref(x, wq, ws) - gemv_ref(x, w)
    assert float((err**2).mean() / (gemv_ref(x, w) ** 2).mean()) < 2e-3  # e4m3: ~4e-4 NMSE per weight


def test_strided_x_and_dispatch():
    x, w = _inputs(17, 136, 40, torch.float32)
    wide = torch.zeros(17, 200, device=DEVICE)
    wide[:, :136] = x
    with backend("triton"):
        torch.testing.assert_close(gemv(wide[:3, :136], w), gemv_ref(x[:3], w), **TOL[torch.float32])
        torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), atol=0, rtol=0)  # 17 rows: the twin
        wq, ws = quantize_fp8_block_ref(w)
        torch.testing.assert_close(gemv_fp8(x[:2], wq, ws), gemv_fp8_ref(x[:2], wq, ws), **TOL[torch.float32])
        assert gemv(x[:0], w).shape == (0, 40)


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, w: gemv_triton(x, w[:, :-1]),  # K mismatch
        lambda x, w: gemv_triton(x.repeat(9, 1), w),  # 18 rows
        lambda x, w: gemv_triton(x, w.bfloat16()),  # dtype mismatch
        lambda x, w: gemv_triton(x, w.t().contiguous().t()),  # K not unit stride
        lambda x, w: gemv_fp8_triton(x, w, torch.ones(1, 2)),  # not e4m3
        lambda x, w: gemv_fp8_triton(x, w.to(torch.float8_e4m3fn), torch.ones(1, 1)),  # scale shape
    ],
)
def test_launcher_rejects(bad):
    x, w = _inputs(2, 136, 40, torch.float32)
    with pytest.raises(ValueError, match="gemv"):
        bad(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2816, 4096), (4096, 2816), (2816, 2 * 2112), (5376, 5376)])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_real_shapes(rows, k, n, fp8):
    x, w = _inputs(rows, k, n, torch.bfloat16)
    if fp8:
        wq, ws = quantize_fp8_block_ref(w)
        torch.testing.assert_close(gemv_fp8_triton(x, wq, ws), gemv_fp8_ref(x, wq, ws), **TOL[torch.bfloat16])
    else:
        torch.testing.assert_close(gemv_triton(x, w), gemv_ref(x, w), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(A8_CONFIGS))
@pytest.mark.parametrize("k,n", [(2816, 8192), (4096, 2816), (2112, 2816)])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gpu_fp8_a8(rows, k, n, config):
    from sparrow.kernels.fp8_gemm import fp8_gemm_ref

    x, w = _inputs(rows, k, n, torch.bfloat16)
    wq, ws = quantize_fp8_block_ref(w)
    with forced_config(A8_CONFIGS[config]):
        got = gemv_fp8_triton(x, wq, ws)
    torch.testing.assert_close(got, fp8_gemm_ref(x, wq, ws), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2816, 8192), (4096, 2816)])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_swap_ab(rows, k, n, fp8):
    x, w = _inputs(rows, k, n, torch.bfloat16)
    with forced_config(CONFIGS["swap_ab"]):
        if fp8:
            wq, ws = quantize_fp8_block_ref(w)
            torch.testing.assert_close(gemv_fp8_triton(x, wq, ws), gemv_fp8_ref(x, wq, ws), **TOL[torch.bfloat16])
        else:
            torch.testing.assert_close(gemv_triton(x, w), gemv_ref(x, w), **TOL[torch.bfloat16])


if __name__ == "__main__":
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import kernels_micro

    kernels_micro.main(["gemv"])
