"""Small-row GEMV: the Triton launchers against their torch twins.

Shapes: R = rows (<= 16), K = input width, N = output width. On CPU the kernel runs under
TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small. Run as a script on a GPU for GB/s.
"""
import os

import numpy as np
import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
from sparrow.kernels.gemm.gemv import (
    GemvConfig,
    forced_config,
    gemv,
    gemv_fp8,
    gemv_fp8_ref,
    gemv_fp8_triton,
    gemv_ref,
    gemv_triton,
    gemv_w8a8,
    gemv_w8a8_triton,
)
from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 16]
SHAPES = [(40, 136), (136, 40), (1000, 72), (200, 1000)]  # (K, N): odd, ragged against every tile
DTYPES = [torch.float32, torch.bfloat16]
# Outputs are ~N(0, 1). fp32: exact products, only the summation order differs over K <= 1000 terms;
# bf16: the same plus one output rounding (<= 2^-8 relative).
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
CONFIGS = {
    "default": None,
    "dot": GemvConfig(block_n=32, block_k=64),
    "dot_wide_k": GemvConfig(block_n=16, block_k=256),  # FP8: two 128-wide scale blocks a step
    "swap_ab": GemvConfig(block_n=32, block_k=256, swap_ab=True),  # weight as the dot's A side
    # split-K, reduced in the kernel: 3 uneven K ranges (some empty at small K); automatic split with swap AB
    "split_k3": GemvConfig(block_n=16, block_k=64, split_k=3),
    "split_auto_swap": GemvConfig(block_n=32, block_k=128, swap_ab=True, split_k=0),
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


W8A8_CONFIGS = {
    "default": None,
    "swap_split2": GemvConfig(block_n=16, block_k=256, swap_ab=True, split_k=2),  # 2 groups a step
    "swap_split3": GemvConfig(block_n=32, block_k=128, swap_ab=True, split_k=3),
}


def _nmse(y, ref):
    return float(((y.float() - ref.float()) ** 2).mean() / (ref.float() ** 2).mean())


@pytest.mark.parametrize("config", list(W8A8_CONFIGS))
@pytest.mark.parametrize("k,n", [(136, 40), (200, 300)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemv_w8a8_matches_twin(rows, k, n, config):
    """W8A8 mode: x quantized per row and 128-column group in the kernel; the oracle is fp8_gemm's twin (the
    same quantization in torch, then dequantized operands in fp32). An e4m3 rounding of x may differ where
    the kernel's division rounds differently from torch's, so the budget is an NMSE, not ulps."""
    x, w = _inputs(rows, k, n, torch.bfloat16, seed=rows)
    wq, ws = quantize_fp8_block_ref(w.float())
    cfg = W8A8_CONFIGS[config]
    if cfg is None:
        y = gemv_w8a8_triton(x, wq, ws)
    else:
        with forced_config(cfg):
            y = gemv_w8a8_triton(x, wq, ws)
    assert y.dtype == x.dtype and y.shape == (rows, n)
    assert _nmse(y, fp8_gemm_ref(x, wq, ws)) <= 5e-5


def test_gemv_w8a8_rejects_tiles_off_the_scale_groups():
    x, w = _inputs(2, 256, 32, torch.bfloat16)
    wq, ws = quantize_fp8_block_ref(w.float())
    for bad in (GemvConfig(block_n=32, block_k=64, swap_ab=True),  # a dot across two groups
                GemvConfig(block_n=32, block_k=128)):  # plain e4m3 dots: wrong sums on the H200
        with forced_config(bad), pytest.raises(ValueError, match="swap_ab and block_k"):
            gemv_w8a8_triton(x, wq, ws)
    with pytest.raises(ValueError, match="rows"):
        gemv_w8a8_triton(x.repeat(9, 1), wq, ws)
    # the dispatcher: past 16 rows (or on CPU) the twin
    torch.testing.assert_close(gemv_w8a8(x.repeat(9, 1), wq, ws), fp8_gemm_ref(x.repeat(9, 1), wq, ws))


@pytest.mark.parametrize("rows", [17, 40])
def test_gemv_fp8_above_16_rows(rows, monkeypatch):
    """With a table entry past 16 rows the W8A16 GEMV pads the rows to a power of two >= 16 (BLOCK_R 32 / 64),
    and FP8 linears take it up to ``FP8_MAX_ROWS``."""
    from sparrow.kernels.gemm import gemv

    monkeypatch.setattr(gemv, "FP8_GEMV_CONFIGS", ((64, GemvConfig(block_n=16, block_k=128, split_k=2)),))
    x, w = _inputs(rows, 256, 48, torch.float32)
    wq, ws = quantize_fp8_block_ref(w)
    torch.testing.assert_close(gemv_fp8_triton(x, wq, ws), gemv_fp8_ref(x, wq, ws), **TOL[torch.float32])
    with pytest.raises(ValueError, match="rows"):
        gemv_fp8_triton(x.repeat(4, 1), wq, ws)  # past the table's last bound


def test_split_k_counters_reset_and_result_deterministic():
    """Each tile's last program resets its counter, so calls can follow each other without a memset; the
    partials are summed in split order, so repeated calls agree bit for bit."""
    from sparrow.kernels.common import split_k

    x, w = _inputs(3, 1000, 72, torch.float32)
    with forced_config(GemvConfig(block_n=16, block_k=64, split_k=5)):
        first = gemv_triton(x, w)
        again = gemv_triton(x, w)
    locks = split_k.workspace(x.device, 0, 0)[1]
    assert int(locks.abs().sum()) == 0
    assert torch.equal(first, again)
    torch.testing.assert_close(first, gemv_ref(x, w), **TOL[torch.float32])


def test_split_k_falls_back_when_the_workspace_is_too_small(monkeypatch):
    from sparrow.kernels.common import split_k

    monkeypatch.setattr(split_k, "WORKSPACE_FLOATS", 16)
    x, w = _inputs(2, 1000, 72, torch.float32)
    with forced_config(GemvConfig(block_n=16, block_k=64, split_k=4)):
        torch.testing.assert_close(gemv_triton(x, w), gemv_ref(x, w), **TOL[torch.float32])


def test_pick_config_narrows_only_without_split_k(monkeypatch):
    from sparrow.kernels.gemm import gemv

    assert gemv.pick_config(1, 2816, fp8=True) == gemv.FP8_GEMV_CONFIGS[0][1]  # automatic split-K: kept as tuned
    plain = GemvConfig(block_n=64, block_k=256)
    monkeypatch.setattr(gemv, "GEMV_CONFIGS", ((gemv.MAX_ROWS, plain),))
    assert gemv.pick_config(1, 2816, fp8=False).block_n == 16  # 44 tiles -> 176 programs
    assert gemv.pick_config(1, 8192, fp8=False).block_n == 32  # 128 tiles -> 256 programs
    assert gemv.pick_config(1, 16384, fp8=False).block_n == 64  # 256 tiles: enough
    with forced_config(plain):
        assert gemv.pick_config(1, 2816, fp8=False) is plain


def test_choose_split():
    from sparrow.kernels.common.split_k import FILL_PROGRAMS, MAX_SPLIT, MAX_TILES, choose_split

    assert choose_split(88, 44, 0) == -(-FILL_PROGRAMS // 88)  # auto: fill the GPU
    assert choose_split(1, 1000, 0) == MAX_SPLIT
    assert choose_split(88, 2, 0) == 2  # never more splits than K steps
    assert choose_split(88, 44, 3) == 3
    assert choose_split(MAX_TILES + 1, 44, 4) == 1
    with pytest.raises(ValueError, match="split_k"):
        choose_split(88, 44, -1)


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
@pytest.mark.parametrize("k,n", [(2816, 4096), (4096, 2816)])
@pytest.mark.parametrize("rows", [17, 32, 64])
def test_gpu_fp8_above_16_rows(rows, k, n):
    """The table's entries past 16 rows (FP8_MAX_ROWS = 64), rows padded to 32 / 64."""
    x, w = _inputs(rows, k, n, torch.bfloat16)
    wq, ws = quantize_fp8_block_ref(w)
    torch.testing.assert_close(gemv_fp8_triton(x, wq, ws), gemv_fp8_ref(x, wq, ws), **TOL[torch.bfloat16])


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
@pytest.mark.parametrize("block_n,block_k", [(64, 128), (128, 256)])
@pytest.mark.parametrize("k,n", [(2816, 8192), (4096, 2816), (2112, 2816)])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_w8a8_real_shapes(rows, k, n, block_n, block_k):
    x, w = _inputs(rows, k, n, torch.bfloat16)
    wq, ws = quantize_fp8_block_ref(w)
    with forced_config(GemvConfig(block_n=block_n, block_k=block_k, swap_ab=True, split_k=0)):
        y = gemv_w8a8_triton(x, wq, ws)
    assert _nmse(y, fp8_gemm_ref(x, wq, ws)) <= 5e-5
    assert _nmse(gemv_w8a8(x, wq, ws), fp8_gemm_ref(x, wq, ws)) <= 5e-5  # the table's config


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2816, 8192), (2112, 2816)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gpu_w8a8_fp32_activations(rows, k, n):
    """fp32 x (an fp32 model quantized at load): quantized in registers like bf16 x, fp32 out, the table's tile."""
    x, w = _inputs(rows, k, n, torch.float32)
    wq, ws = quantize_fp8_block_ref(w)
    y = gemv_w8a8(x, wq, ws)
    assert y.dtype == torch.float32 and _nmse(y, fp8_gemm_ref(x, wq, ws)) <= 5e-5


_SIDE = []


def _side_stream():
    """One side stream for the module, registered for its own split-K workspace (as Gemma 4's is)."""
    from sparrow.kernels.common import split_k

    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
        split_k.register_concurrent_stream(_SIDE[0])
    return _SIDE[0]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 8, 0])
@pytest.mark.parametrize("k,n", [(4096, 2816), (2112, 2816)])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_split_k_in_graphs_and_two_streams(split, k, n, fp8):
    """Split-K at real shapes: many launches in a row, inside a CUDA graph (replayed), and on two streams
    at once, each against the twin; the counters end at zero."""
    from sparrow.kernels.common import split_k

    xs = [_inputs(r, k, n, torch.bfloat16, seed=r)[0] for r in (1, 5, 16)]
    w = _inputs(1, k, n, torch.bfloat16)[1]
    wq, ws = quantize_fp8_block_ref(w)

    def call(x):
        return gemv_fp8_triton(x, wq, ws) if fp8 else gemv_triton(x, w)

    def ref(x):
        return gemv_fp8_ref(x, wq, ws) if fp8 else gemv_ref(x, w)

    side = _side_stream()
    with forced_config(GemvConfig(block_n=32, block_k=256, split_k=split)):
        for _ in range(20):
            outs = [call(x) for x in xs]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            side_outs = [call(x) for x in xs]
            for _ in range(20):
                side_outs = [call(x) for x in xs]
        main_outs = [call(x) for x in xs]  # concurrent with the side stream's launches
        torch.cuda.current_stream().wait_stream(side)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            [call(x) for x in xs]  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            in_capture = split_k.workspace(xs[0].device, 1, 1)
            graph_outs = [call(x) for x in xs]
        for _ in range(5):
            graph.replay()
    torch.cuda.synchronize()
    assert in_capture is split_k.workspace(xs[0].device, 1, 1)  # the main set, split-K inside the graph too
    with torch.cuda.stream(side):
        side_set = split_k.workspace(xs[0].device, 1, 1)
    assert side_set is not None and side_set is not in_capture  # the side stream's own set
    for x, a, b, c, d in zip(xs, outs, side_outs, main_outs, graph_outs):
        for got in (a, b, c, d):
            torch.testing.assert_close(got, ref(x), **TOL[torch.bfloat16])
    assert len(split_k._SETS[("cuda", torch.cuda.current_device())]) == split_k.SETS
    for locks in (bufs[1] for sets in split_k._SETS.values() for bufs in sets):
        assert int(locks.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2816, 8192), (4096, 2816)])
@pytest.mark.parametrize("rows", [1, 4, 5])
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

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    import kernels_micro

    kernels_micro.main(["gemv"])
