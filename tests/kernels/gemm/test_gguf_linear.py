"""The dense GGUF linear (``sparrow.kernels.gemm.gguf``): the Triton kernel against its torch twin, the twin against
an fp64 matmul of gguf-py-dequantized weights, and the errors. CPU: TRITON_INTERPRET=1 at small shapes
(tests/conftest.py); GPU-marked tests at model shapes (and the same small tests run the compiled kernel there).

Weights are random GGUF blocks (tests/kernels/common/test_gguf_blocks.py ``random_blocks``: random bytes, fp16
fields finite in [-2, 2]), so every bit pattern of the quants is reached. The GPU tests at model shapes keep
the fp16 fields (d, dmin) in [-MODEL_D, MODEL_D], the scale of a real model's blocks: gguf-py's quantizer sets d
= max |w| / max |q| per block, about 1e-4 .. 1e-3 for LLM weights (|w| <= ~0.1 .. 1). With [-2, 2] a K-quant
weight reaches ~2000 and a 4096-long fp16 output overflows (inf in the reference, nan in the difference).

Tolerance (``_bound``), per output element, from the standard bound on a computed dot product (Higham, Accuracy
and Stability of Numerical Algorithms, 3.1): an fp32 sum of K products, each product rounded once, is within
gamma_K * sum |x| |w| of the exact dot, gamma_K = K u / (1 - K u), u = 2^-24. The kernel and the twin multiply the
same x by the same weights (both dequantize bit-exactly and round the weight to x's dtype) and differ only in the
order of their fp32 sums (FMA chains, tensor-core dots, split-K partials, MKL's blocking), so they are within
2 gamma_K sum |x| |w|; we allow twice that (tensor-core accumulation is not documented to round as IEEE fp32
adds). A bf16 / fp16 y is then rounded once by each side: values straddling a rounding boundary differ by one
unit in the last place, 2^-8 (bf16) / 2^-11 (fp16) of |y| relative, allowed as 2^-7 / 2^-10 of |y|. The bias
add is one more fp32 rounding (u |y|).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from sparrow.errors import ModelLoadError, UnsupportedGGUFTypeError
from sparrow.kernels import backend
from sparrow.kernels.common.gguf_blocks import block_bytes
from sparrow.kernels.gemm import gguf as gg
from sparrow.kernels.gemm.gguf import GgufConfig, forced_config, gguf_linear, gguf_linear_ref, gguf_weight_bytes
from tests.kernels.common.test_gguf_blocks import random_blocks

BLOCK_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
U32 = 2.0 ** -24
OUT_ULP = {torch.float32: U32, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (rows, x dtype, bias): FMA GEMV (1, 2, 3 rows), dot GEMV (16), GEMM (17, 40)
CPU_CASES = ((1, torch.float32, True), (2, torch.bfloat16, False), (3, torch.float32, False),
             (16, torch.bfloat16, True), (17, torch.float32, True), (40, torch.bfloat16, False))


def _qweight(qtype: T, n: int, k: int, seed: int, device: str = DEVICE, fp16_max: float = 2.0) -> torch.Tensor:
    blocks = random_blocks(qtype, (n, k), np.random.default_rng(seed), fp16_max)
    return torch.from_numpy(blocks).reshape(n, -1).to(device)


def _gguf_py_weight(qweight: torch.Tensor, qtype: T) -> torch.Tensor:
    """The oracle's weight: gguf-py's dequantization of the blocks, fp32 [N, K]."""
    return torch.from_numpy(gq.dequantize(qweight.cpu().numpy(), qtype).copy())


def _bound(x: torch.Tensor, w: torch.Tensor, want: torch.Tensor, sums: float) -> torch.Tensor:
    """Per-element tolerance: ``sums`` x gamma_K x (|x| @ |w|^T), plus the output and bias roundings (module doc).
    w: the fp32 weight the kernel multiplies (already rounded to x's dtype)."""
    k = x.shape[1]
    gamma = k * U32 / (1 - k * U32)
    mag = x.double().abs().cpu() @ w.double().abs().t()
    return sums * gamma * mag + (OUT_ULP[x.dtype] + U32) * want.double().abs().cpu() + 1e-30


def _assert_within(got, want, bound):
    err = (got.double().cpu() - want.double().cpu()).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (f"max excess at {worst}: |got - want| = {err.flatten()[worst]:.3g} > "
                                        f"{bound.flatten()[worst]:.3g}")


def _compare_kernel(qweight, qtype, x, bias):
    with backend("triton"):
        got = gguf_linear(x, qweight, qtype, bias)
    want = gguf_linear_ref(x, qweight, qtype, bias)
    assert got.dtype == x.dtype and got.shape == want.shape
    w = _gguf_py_weight(qweight, qtype).to(x.dtype).float()
    _assert_within(got, want, _bound(x, w, want, sums=4))


def _x(rows, k, dtype, seed, device=DEVICE):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_linear_kernel_vs_twin(qtype):
    """Every path (FMA GEMV, dot GEMV, GEMM; automatic split-K) on N = 40 (not a multiple of the tile) and K = 512
    (K-quants) / 160 (32-element types: not a multiple of BLOCK_K, the tail tile wraps)."""
    block, _ = block_bytes(qtype)
    n, k = 40, 512 if block == 256 else 160
    qweight = _qweight(qtype, n, k, seed=int(qtype))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for rows, dtype, with_bias in CPU_CASES:
        _compare_kernel(qweight, qtype, _x(rows, k, dtype, seed=rows), bias if with_bias else None)


@pytest.mark.parametrize("cfg,rows,dtype", [
    (GgufConfig(block_m=1, block_n=16, block_k=32, split_k=3, fma=True), 1, torch.float16),
    (GgufConfig(block_m=4, block_n=32, block_k=64, split_k=5, fma=True), 3, torch.bfloat16),
    (GgufConfig(block_m=16, block_n=16, block_k=256, split_k=2), 5, torch.float16),
    (GgufConfig(block_m=16, block_n=32, block_k=32), 33, torch.float32),
])
def test_gguf_linear_forced_tiles(cfg, rows, dtype):
    """Forced tiles: explicit split-K over uneven K ranges (16 steps in 3 or 5, an empty last split), BLOCK_K
    below one K-quant super-block (32 = one sub-block per step), fp16 x, a GEMM of several M tiles."""
    qtype, n, k = T.Q4_K, 24, 512
    qweight = _qweight(qtype, n, k, seed=5)
    with forced_config(cfg):
        _compare_kernel(qweight, qtype, _x(rows, k, dtype, seed=9), None)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_gguf_linear_twin_vs_fp64(qtype, dtype, monkeypatch):
    """The twin against x @ W^T in fp64 with W from gguf-py (rounded to x's dtype, the twin's contract), in
    chunks of 3 rows (TWIN_CHUNK_ELEMS lowered) so the chunking is exercised: within gamma_K sum |x| |w| plus
    the output and bias roundings."""
    block, _ = block_bytes(qtype)
    n, k = 20, 512 if block == 256 else 96
    monkeypatch.setitem(gg.TWIN_CHUNK_ELEMS, "cpu", 3 * k)
    qweight = _qweight(qtype, n, k, seed=3, device="cpu")
    x = _x(4, k, dtype, seed=4, device="cpu")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = gguf_linear_ref(x, qweight, qtype, bias)
    w = _gguf_py_weight(qweight, qtype).to(dtype).float()
    exact = x.double() @ w.double().t() + bias.double()
    assert got.dtype == dtype
    _assert_within(got, exact, _bound(x, w, exact, sums=1))


def test_twin_buffers_made_in_inference_mode_serve_plain_calls(monkeypatch):
    """The twin's reused CPU buffers, first made by a call in inference mode (an engine step), are written again
    by a later call outside it (a layer called directly), with the same result."""
    monkeypatch.setattr(gg, "_TWIN_BUFFERS", {})
    qtype = BLOCK_TYPES[0]
    qweight = _qweight(qtype, 8, 256, seed=3, device="cpu")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        first = gg.gguf_linear_ref(x, qweight, qtype)
    assert torch.equal(gg.gguf_linear_ref(x, qweight, qtype), first)


def test_twin_output_is_contiguous_like_f_linear():
    """The twin returns a contiguous [R, N] in every dtype, as F.linear does: structured output masks the LM
    head's logits in place (xgrammar's CPU bitmask), which a transposed view defeated (SmolLM2 stopped after
    '{"')."""
    qtype = BLOCK_TYPES[0]
    qweight = _qweight(qtype, 8, 256, seed=3, device="cpu")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = gg.gguf_linear_ref(x, qweight, qtype)
        assert y.shape == (3, 8) and y.dtype == dtype and y.is_contiguous()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_twin_dequantize_rows_bit_exact(qtype):
    """The twin's own CPU decoders (``dequantize_rows``: fast paths for the hot types) equal gguf-py's
    dequantization bit for bit, written into a reused, larger buffer."""
    n, k = 6, 512
    qweight = _qweight(qtype, n, k, seed=13, device="cpu")
    out = torch.full((n, k), float("nan"))
    scratch = torch.full((2 * n * k,), 255, dtype=torch.uint8)
    got = gg.dequantize_rows(qweight, qtype, out, scratch)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, _gguf_py_weight(qweight, qtype))


def test_pick_config_batch1_by_type():
    """One row takes the type's GEMV1_BY_TYPE tile (Q6_K, Q8_0; run at rows = 1 by the kernel tests above),
    other types and rows GGUF_CONFIGS; a forced config overrides both."""
    for qtype, tile in gg.GEMV1_BY_TYPE.items():
        assert gg.pick_config(1, None, qtype) == tile and tile.fma and tile.block_m == 1
        assert gg.pick_config(2, None, qtype) == gg.GGUF_CONFIGS[1][1]
    assert gg.pick_config(1, None, T.Q4_K) == gg.pick_config(1) == gg.GGUF_CONFIGS[0][1]
    forced = GgufConfig(block_m=1, block_n=16, block_k=32, fma=True)
    with forced_config(forced):
        assert gg.pick_config(1, None, T.Q6_K) == forced


def test_gguf_linear_empty_and_bytes():
    qweight = _qweight(T.Q4_0, 8, 64, seed=0, device="cpu")
    assert gguf_weight_bytes(qweight) == 8 * 2 * 18
    assert gguf_linear_ref(torch.zeros(0, 64), qweight, T.Q4_0).shape == (0, 8)
    with backend("triton"):
        assert gguf_linear(torch.zeros(0, 64), qweight, T.Q4_0).shape == (0, 8)


@pytest.mark.parametrize("op", (gguf_linear_ref, gg.gguf_linear_triton), ids=("twin", "triton"))
def test_gguf_linear_errors(op):
    q8 = _qweight(T.Q8_0, 4, 64, seed=0, device="cpu")  # [4, 68]
    x = torch.randn(2, 64)
    with pytest.raises(ModelLoadError, match=r"K = 48 is not a multiple of the Q8_0 block of 32"):
        op(torch.randn(2, 48), q8, T.Q8_0)
    with pytest.raises(UnsupportedGGUFTypeError, match=r"ggml type F16 has no GGUF kernel"):
        op(x, q8, T.F16)
    with pytest.raises(UnsupportedGGUFTypeError, match=r"unknown ggml type 99"):
        op(x, q8, 99)
    with pytest.raises(ModelLoadError, match=r"qweight must be uint8 \[N, 68\].*got \(4, 67\)"):
        op(x, q8[:, :67], T.Q8_0)
    with pytest.raises(ModelLoadError, match=r"uint8 \[N, 40\] \(Q4_1: K = 64 in 2 blocks of 20 bytes\)"):
        op(x, q8, T.Q4_1)  # Q4_1: 2 blocks of 20 bytes a row, not 68
    with pytest.raises(ModelLoadError, match=r"x must be fp32 / bf16 / fp16"):
        op(x.to(torch.int32), q8, T.Q8_0)
    with pytest.raises(ModelLoadError, match=r"bias must be a float \[4\]"):
        op(x, q8, T.Q8_0, torch.zeros(5))


# --- GPU: model shapes (Llama-3-8B-size q/o and down projections), every path ---

GPU_SHAPES = ((T.Q4_K, 4096, 4096), (T.Q6_K, 14336, 4096), (T.Q8_0, 4096, 4096), (T.Q2_K, 4096, 4096),
              (T.Q5_0, 2048, 640))
GPU_ROWS = (1, 2, 3, 4, 8, 16, 17, 64, 256)
MODEL_D = 2.0 ** -10
"""fp16 scale fields of the model-shape weights (module doc): |w| <= 63 * 15 * 2^-10 (Q4_K) .. 4 (Q6_K)."""


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,n,k", GPU_SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_linear_gpu(qtype, n, k):
    """Every path on CUDA against the twin on CUDA (rows 1-4: FMA GEMV, 8 and 16: dot GEMV, including the 2-,
    3- and m-row verify batches of speculative decoding; 17+: GEMM), bf16 / fp16 / fp32 x, bias on odd R."""
    qweight = _qweight(qtype, n, k, seed=1, device="cuda", fp16_max=MODEL_D)
    bias = torch.randn(n, device="cuda")
    w32 = _gguf_py_weight(qweight, qtype)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = w32.to(dtype).float()
        for rows in GPU_ROWS:
            x = _x(rows, k, dtype, seed=rows, device="cuda")
            got = gguf_linear(x, qweight, qtype, bias if rows % 2 else None)
            with backend("torch"):
                want = gguf_linear(x, qweight, qtype, bias if rows % 2 else None)
            assert torch.isfinite(want).all(), f"{qtype.name} {dtype} R={rows}: the reference overflowed"
            _assert_within(got, want, _bound(x.cpu(), w, want, sums=4))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,n,k", GPU_SHAPES[:3], ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_gemv_bandwidth_gpu(qtype, n, k):
    """Batch-1 decode GEMV: correct, and its achieved bandwidth printed (run with -s, or this file as a script)
    beside a device copy's measured in the same run (target: >= 60 % for Q4_K / Q8_0 on an H100; not asserted:
    the tiles are untuned)."""
    qweight = _qweight(qtype, n, k, seed=2, device="cuda", fp16_max=MODEL_D)
    x = _x(1, k, torch.bfloat16, seed=0, device="cuda")
    got = gguf_linear(x, qweight, qtype)
    with backend("torch"):
        want = gguf_linear(x, qweight, qtype)
    _assert_within(got, want, _bound(x.cpu(), _gguf_py_weight(qweight, qtype).to(x.dtype).float(), want, sums=4))
    gemv_s = _cuda_seconds(lambda: gguf_linear(x, qweight, qtype))
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_s = _cuda_seconds(lambda: big.clone())
    copy_bw = 2 * big.numel() / copy_s
    bw = gguf_weight_bytes(qweight) / gemv_s
    print(f"\n{qtype.name} {n}x{k} R=1: {gemv_s * 1e6:.1f} us, {bw / 1e9:.0f} GB/s = {100 * bw / copy_bw:.0f} % "
          f"of copy ({copy_bw / 1e9:.0f} GB/s), {torch.cuda.get_device_name()}")


def _cuda_seconds(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


if __name__ == "__main__":  # micro-benchmark: python -m tests.kernels.gemm.test_gguf_linear (needs CUDA)
    for shape in GPU_SHAPES:
        test_gguf_gemv_bandwidth_gpu(*shape)
