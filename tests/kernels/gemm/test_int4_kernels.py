"""int4 W4A16 Triton kernels (``sparrow.kernels.gemm.int4`` / ``int4_moe``) against their torch twins (the
dequantize-then-matmul references). CPU: TRITON_INTERPRET=1 at tiny shapes (tests/conftest.py; the same tests run the kernels on a GPU); GPU-marked tests at model shapes.

Budgets: fp32 activations and scales: the twin multiplies x by the dequantized fp32 weights, the kernel sums
x * (u - zero) and scales the sums per group (GEMV tiles) or scales the weight tile (GEMM tiles), all in fp32,
so they differ only in rounding order (atol 1e-4 on outputs of magnitude ~1). bf16: the twin rounds each weight
to bf16 (2^-9 relative), the GEMV tiles keep it exact (the GEMM tiles round it as the twin does), fp32
accumulation, one rounding of the output to bf16 (NMSE <= 1e-5; one bf16 rounding alone is ~1e-6). MoE in bf16:
the twin rounds gate|up to bf16 before the activation and the kernel applies it to the fp32 sums, so the
intermediate [P, I] carries one more bf16 rounding on one side (NMSE <= 1e-4)."""
from __future__ import annotations

import functools

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.int4 import Int4Config, forced_config, int4_linear, int4_linear_ref, quantize_int4_ref
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config as moe_forced_config
from sparrow.kernels.moe.int4_moe import int4_fused_moe, int4_fused_moe_ref
from tests.helpers import nmse

FP32_ATOL = 1e-4
BF16_NMSE = 1e-5
MOE_BF16_NMSE = 1e-4
CPU_ROWS = (1, 2, 3, 16, 17)
GPU_ROWS = (1, 2, 3, 16, 17, 64, 65, 1024)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the tiny-shape tests: the interpreter on CPU


def _weights(n, k, group, symmetric, scale_dtype, device="cpu", seed=0):
    """Random weights [n, k] quantized on ``device`` -> (packed, scale, zero)."""
    w = torch.randn(n, k, generator=torch.Generator(device).manual_seed(seed), device=device) * 0.1
    return quantize_int4_ref(w, group, symmetric, scale_dtype)


def _check(got, want, dtype, budget=BF16_NMSE):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
    else:
        assert nmse(got, want) <= budget


@pytest.mark.parametrize("rows", CPU_ROWS)
@pytest.mark.parametrize("symmetric,group,scale_dtype,dtype", [
    (True, 32, torch.float32, torch.float32), (False, 64, torch.float32, torch.float32),
    (False, 32, torch.bfloat16, torch.bfloat16)])
def test_int4_linear_interpreter(rows, symmetric, group, scale_dtype, dtype):
    n, k = 40, 192  # N not a multiple of the tile, K not of BLOCK_K
    packed, scale, zero = _weights(n, k, group, symmetric, scale_dtype, DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    with backend("triton"):
        got = int4_linear(x, packed, scale, zero, group)
    _check(got, int4_linear_ref(x, packed, scale, zero, group), dtype)


@pytest.mark.parametrize("rows", (1, 3, 17))
def test_int4_gemv_split_k_interpreter(rows):
    """Forced tiles, asymmetric fp32 (equal to the twin up to summation order): K split over 3 programs (reduced
    in the kernel) with BLOCK_K below the group (SUB_K = BLOCK_K, several steps per group); plain dots with
    automatic split-K; a GEMM tile (scales on the weight tile, several M tiles at 17 rows)."""
    n, k, group = 40, 192, 64
    packed, scale, zero = _weights(n, k, group, False, torch.float32, DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    for cfg in (Int4Config(block_m=16, block_n=16, block_k=32, split_k=3, swap_ab=True),
                Int4Config(block_m=16, block_n=32, block_k=128, split_k=0),
                Int4Config(block_m=16, block_n=16, block_k=64, scale_w=True)):
        with backend("triton"), forced_config(cfg):
            got = int4_linear(x, packed, scale, zero, group)
        _check(got, int4_linear_ref(x, packed, scale, zero, group), torch.float32)


def test_int4_moe_small_split_k_interpreter():
    """The small MoE path with K split over 2 programs per (pair, N tile), 3 rows, bf16."""
    x, w13, w2, wts, ids = _moe_case(3, 4, 64, 32, 2, 32, True, torch.bfloat16, torch.bfloat16, DEVICE)
    want = int4_fused_moe_ref(x, *w13, *w2, 32, wts, ids, "gelu_pytorch_tanh")
    for tile in (Tile(block_n=16, block_k=32, split_k=2), Tile(block_n=16, block_k=32, split_k=2, swap_ab=True)):
        with backend("triton"), moe_forced_config(MoeConfig(16, tile, tile)):
            got = int4_fused_moe(x, *w13, *w2, 32, wts, ids, "gelu_pytorch_tanh")
        _check(got, want, torch.bfloat16, MOE_BF16_NMSE)


def test_int4_moe_grouped_plain_tiles_interpreter():
    """The grouped path with plain (unswapped) dots, the default's choice from 64 pairs an expert, 17 rows."""
    x, w13, w2, wts, ids = _moe_case(17, 4, 64, 32, 2, 32, False, torch.float32, torch.float32, DEVICE)
    want = int4_fused_moe_ref(x, *w13, *w2, 32, wts, ids, "silu", pair_threshold=0)
    tile = Tile(block_n=32, block_k=32)
    with backend("triton"), moe_forced_config(MoeConfig(16, tile, tile)):
        got = int4_fused_moe(x, *w13, *w2, 32, wts, ids, "silu", pair_threshold=0)
    _check(got, want, torch.float32)


@functools.lru_cache(maxsize=2)
def _moe_weights(e, h, i, group, symmetric, scale_dtype, device):
    return (_weights(e * 2 * i, h, group, symmetric, scale_dtype, device, 1),
            _weights(e * h, i, group, symmetric, scale_dtype, device, 2))


def _moe_case(rows, e, h, i, k, group, symmetric, scale_dtype, dtype, device="cpu"):
    g = torch.Generator().manual_seed(rows)
    w13, w2 = _moe_weights(e, h, i, group, symmetric, scale_dtype, device)
    stack = lambda t, n: None if t is None else t.reshape(e, n, -1)  # noqa: E731
    w13 = tuple(stack(t, 2 * i) for t in w13)
    w2 = tuple(stack(t, h) for t in w2)
    x = torch.randn(rows, h, generator=g).to(dtype).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).to(device)
    wts = torch.softmax(torch.randn(rows, k, generator=g), -1).to(device)
    return x, w13, w2, wts, ids


@pytest.mark.parametrize("rows", CPU_ROWS)
@pytest.mark.parametrize("symmetric,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_int4_moe_interpreter(rows, symmetric, dtype):
    """Small path (P <= pair_threshold) and grouped path (threshold 0): the Triton kernels vs the twin."""
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    x, w13, w2, wts, ids = _moe_case(rows, 4, 64, 32, 2, 32, symmetric, scale_dtype, dtype, DEVICE)
    for threshold in (64, 0):
        want = int4_fused_moe_ref(x, *w13, *w2, 32, wts, ids, "silu", pair_threshold=threshold)
        with backend("triton"):
            got = int4_fused_moe(x, *w13, *w2, 32, wts, ids, "silu", pair_threshold=threshold)
        _check(got, want, dtype, MOE_BF16_NMSE)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("n,k", [(4096, 2816), (2816, 2112)])
def test_int4_linear_gpu(rows, n, k):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    packed, scale, zero = _weights(n, k, 128, True, torch.bfloat16, "cuda")
    x = torch.randn(rows, k, device="cuda").bfloat16()
    got = int4_linear(x, packed, scale, zero, 128)
    want = int4_linear_ref(x.float(), packed, scale.float(), zero, 128)  # fp32 twin on the bf16 weights
    assert nmse(got, want) <= BF16_NMSE


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_int4_moe_gpu(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w13, w2, wts, ids = _moe_case(rows, 128, 2816, 704, 8, 64, False, torch.bfloat16, torch.bfloat16, "cuda")
    got = int4_fused_moe(x, *w13, *w2, 64, wts, ids, "gelu_pytorch_tanh")
    with backend("torch"):
        want = int4_fused_moe_ref(x.float(), *w13, *w2, 64, wts, ids, "gelu_pytorch_tanh")
    assert nmse(got, want) <= MOE_BF16_NMSE


if __name__ == "__main__":  # micro-benchmark: us per call and GB/s of int4 weight bytes
    import triton.testing

    for n, k in ((4096, 2816), (2816, 2112), (8192, 2816)):
        packed, scale, zero = _weights(n, k, 128, True, torch.bfloat16, "cuda")
        for rows in (1, 16, 64, 1024):
            x = torch.randn(rows, k, device="cuda").bfloat16()
            us = triton.testing.do_bench(lambda: int4_linear(x, packed, scale, zero, 128)) * 1e3
            gbs = (packed.numel() * 4 + scale.numel() * 2) / us / 1e3
            print(f"int4_linear {n} x {k} rows {rows}: {us:.1f} us, {gbs:.0f} GB/s of weights")
