"""GGUF routed experts (``sparrow.kernels.moe.gguf_moe``): the Triton kernels on raw ggml blocks (small per-pair
path and grouped path) against the torch twin, the twin against an fp64 computation on gguf-py's dequantized
weights, and the errors. CPU: TRITON_INTERPRET=1 (tests/conftest.py) at E = 4..8, top-2, H = 256 / 512, I = 256
(K-quant down) or 64 / 96 (32-element down types); GPU-marked tests at gemma4-26b-a4b's and qwen3-30b-a3b's shapes.

Weights are random ggml blocks (random quant bytes, the fp16 d / dmin / m fields drawn in [-1, 1] and scaled so the
weights' rms is 1 / sqrt(K): outputs O(1)).

Budgets. fp32 activations: the twin dequantizes exactly to fp32 (bit-exact blocks) and runs fp32 matmuls; the
kernel decodes the same fp32 weights (``dequant_tile``, bit-exact) and sums in fp32 in another order, so the
outputs differ by summation order only: atol = rtol = 1e-4 on O(1) outputs (the float experts' fp32 budget).
bf16 / fp16: the twin rounds every weight, the gate|up product, the activation and each pair's output to x's dtype;
the kernel rounds the weights only on its dot path (its 1-4-row FMA path keeps them fp32) and takes the
activation from fp32 accumulators, so the two differ by a few roundings of 2^-9 relative (bf16), each ~1e-6 of
NMSE, amplified where gate|up cancels: NMSE <= 1e-4 (the int4 / NVFP4 experts' budget). Measured here: <= 3e-5
kernel vs twin, most of it the twin's own roundings (the bf16 twin is 2.4e-5 from its fp32 run, the kernel 1.4e-5).
The twin vs fp64: fp32 sums over K <= 512 terms against exact sums, rtol = atol = 1e-5.

Run as a script on a GPU: ``python tests/kernels/moe/test_gguf_moe.py`` prints each shape's time and GB/s of the
expert blocks it reads against the measured copy bandwidth.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from sparrow.errors import ModelLoadError, UnsupportedGGUFTypeError
from sparrow.kernels import backend
from sparrow.kernels.common.gguf_blocks import block_bytes, dequantize
from sparrow.kernels.moe.gguf_moe import gguf_fused_moe, gguf_fused_moe_ref, gguf_fused_moe_triton
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config
from tests.helpers import nmse
from tests.kernels.common.test_gguf_blocks import FP16_FIELDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
HALF_NMSE = 1e-4
GROUPED = 0  # pair_threshold forcing the grouped path


def random_experts(qtype: T, experts: int, rows: int, cols: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """uint8 [E, rows, cols / B * T]: random ggml blocks, fp16 fields scaled so the weights' rms is 1 / sqrt(cols)
    (every ggml type is linear in its fp16 fields, so scaling them all scales the weights)."""
    elems, nbytes = block_bytes(qtype)
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randint(0, 256, (experts * rows * cols // elems, nbytes), generator=g, dtype=torch.uint8,
                           device=device)
    fields = [torch.rand(blocks.shape[0], generator=g, device=device) * 2 - 1 for _ in FP16_FIELDS[qtype]]

    def set_fields(scale: float) -> None:
        for off, f in zip(FP16_FIELDS[qtype], fields):
            blocks[:, off:off + 2] = (f * scale).to(torch.float16).view(torch.uint8).view(-1, 2)

    set_fields(1.0)
    sample = blocks[:min(blocks.shape[0], 4096)]
    rms = float(dequantize(sample, qtype, (sample.shape[0] * elems,)).pow(2).mean().sqrt())
    set_fields(1.0 / (rms * cols ** 0.5))
    return blocks.reshape(experts, rows, cols // elems * nbytes)


@functools.lru_cache(maxsize=8)
def _weights(t13: T, t2: T, experts: int, hidden: int, width: int, device: str = DEVICE):
    return (random_experts(t13, experts, 2 * width, hidden, 1, device),
            random_experts(t2, experts, hidden, width, 2, device))


def _routing(rows: int, experts: int, top_k: int, hidden: int, dtype, seed: int, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)]).to(device)
    wts = torch.softmax(torch.randn(rows, top_k, generator=g), -1).to(device)
    return x, wts, ids


def _check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:
        assert nmse(got, want) <= HALF_NMSE


# (w13 type, w2 type, E, H, I, small-path rows, grouped-path rows, activation, reduce)
CASES = [
    (T.Q4_K, T.Q6_K, 4, 256, 256, 1, 24, "silu", True),
    (T.Q8_0, T.Q8_0, 8, 512, 64, 3, 40, "gelu_pytorch_tanh", False),
    (T.Q5_0, T.Q4_1, 6, 256, 96, 3, 32, "silu", False),
    (T.Q2_K, T.Q3_K, 4, 256, 256, 3, 24, "gelu_pytorch_tanh", True),
    (T.Q5_K, T.Q8_0, 8, 256, 96, 1, 40, "gelu_pytorch_tanh", True),
]
# the interpreter's time goes with the program count: wide tiles, and split-K 2 to cover the in-kernel reduce
CPU_SMALL = MoeConfig(16, Tile(64, 256, split_k=2, fma_rows=4), Tile(128, 256, split_k=1, fma_rows=4))
CPU_GROUPED = MoeConfig(16, Tile(64, 256), Tile(64, 256, swap_ab=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1].name}")
def test_gguf_moe_interpreter(case, dtype):
    """Both paths (small: its rows, fp32 FMAs, split-K 2; grouped: pair_threshold 0, dots) against the twin."""
    t13, t2, experts, hidden, width, small_rows, grouped_rows, activation, reduce = case
    w13, w2 = _weights(t13, t2, experts, hidden, width)
    for rows, threshold, cfg in ((small_rows, 64, CPU_SMALL), (grouped_rows, GROUPED, CPU_GROUPED)):
        x, wts, ids = _routing(rows, experts, 2, hidden, dtype, seed=rows)
        want = gguf_fused_moe_ref(x, w13, t13, w2, t2, wts, ids, activation, pair_threshold=threshold,
                                  reduce=reduce)
        with backend("triton"), forced_config(cfg):
            got = gguf_fused_moe(x, w13, t13, w2, t2, wts, ids, activation, pair_threshold=threshold, reduce=reduce)
        assert got.shape == (rows if reduce else rows * 2, hidden)
        _check(got, want, dtype)


@pytest.mark.parametrize("rows", [2, 5])
def test_gguf_moe_default_tiles_and_dot_rows(rows):
    """The launcher's own tiles on the small path: 2 rows take FMA rows with automatic split-K, 5 rows the
    swapped 16-row dots (fp16, with DeepSeek-V4's clamp)."""
    dtype = torch.bfloat16 if rows == 2 else torch.float16
    w13, w2 = _weights(T.Q8_0, T.Q8_0, 4, 256, 64)
    x, wts, ids = _routing(rows, 4, 2, 256, dtype, seed=rows)
    want = gguf_fused_moe_ref(x, w13, T.Q8_0, w2, T.Q8_0, wts, ids, swiglu_limit=0.5)
    with backend("triton"):
        got = gguf_fused_moe(x, w13, T.Q8_0, w2, T.Q8_0, wts, ids, swiglu_limit=0.5)
    _check(got, want, dtype)


def test_gguf_moe_lora_on_triton():
    """With adapters the Triton path runs the float kernels on the dequantized experts: the deltas enter as the
    twin's (gate|up before the activation, down before the reduce)."""
    w13, w2 = _weights(T.Q8_0, T.Q8_0, 4, 256, 64)
    x, wts, ids = _routing(2, 4, 2, 256, torch.float32, seed=3)
    g = torch.Generator().manual_seed(5)
    d13, d2 = torch.randn(4, 128, generator=g) * 0.1, torch.randn(4, 256, generator=g) * 0.1

    class Delta:  # ExpertDelta's interface with fixed per-pair deltas
        def gate_up(self, x):
            return d13.clone()

        def down(self, a, y, order=None):
            return y + (d2 if order is None else d2[order])

    want = gguf_fused_moe_ref(x, w13, T.Q8_0, w2, T.Q8_0, wts, ids, lora=Delta())
    assert not torch.allclose(want, gguf_fused_moe_ref(x, w13, T.Q8_0, w2, T.Q8_0, wts, ids))
    with backend("triton"), forced_config(MoeConfig(16, Tile(32, 64), Tile(64, 64))):
        got = gguf_fused_moe(x, w13, T.Q8_0, w2, T.Q8_0, wts, ids, lora=Delta())
    _check(got, want, torch.float32)


def test_gguf_moe_zero_rows():
    """An empty batch gives an empty result on the twin and the kernels alike."""
    w13, w2 = _weights(T.Q8_0, T.Q8_0, 4, 256, 64)
    x = torch.zeros(0, 256, dtype=torch.bfloat16, device=DEVICE)
    ids, wts = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), torch.zeros(0, 2, device=DEVICE)
    for fn in (gguf_fused_moe_ref, gguf_fused_moe_triton):
        for reduce in (True, False):
            out = fn(x, w13, T.Q8_0, w2, T.Q8_0, wts, ids, reduce=reduce)
            assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def _act64(h: np.ndarray, activation: str) -> np.ndarray:
    gate, up = np.split(h, 2, axis=-1)
    if activation == "silu":
        return gate / (1.0 + np.exp(-gate)) * up
    return 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3))) * up


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gguf_moe_twin_against_fp64_gguf_py(activation):
    """The twin (fp32, both paths) against an fp64 computation on gguf-py's own dequantized weights."""
    t13, t2, experts, hidden, width = T.Q4_K, T.Q5_0, 4, 512, 96
    w13, w2 = _weights(t13, t2, experts, hidden, width, "cpu")
    gate_up = gq.dequantize(w13.numpy(), t13).astype(np.float64).reshape(experts, 2 * width, hidden)
    down = gq.dequantize(w2.numpy(), t2).astype(np.float64).reshape(experts, hidden, width)
    x, wts, ids = _routing(5, experts, 2, hidden, torch.float32, seed=11, device="cpu")
    x64, w64, ids64 = x.double().numpy(), wts.double().numpy(), ids.numpy()
    want = np.zeros((5, hidden))
    for r in range(5):
        for k in range(2):
            e = ids64[r, k]
            want[r] += w64[r, k] * (down[e] @ _act64(gate_up[e] @ x64[r], activation))
    for threshold in (64, GROUPED):
        got = gguf_fused_moe_ref(x, w13, t13, w2, t2, wts, ids, activation, pair_threshold=threshold)
        torch.testing.assert_close(got.double(), torch.from_numpy(want), atol=1e-5, rtol=1e-5)


def test_gguf_moe_errors():
    """Bad input raises a sparrow error naming the problem, on both the twin and the Triton launcher."""
    w13, w2 = _weights(T.Q4_K, T.Q8_0, 4, 256, 64, "cpu")
    x, wts, ids = _routing(1, 4, 2, 256, torch.float32, seed=1, device="cpu")
    for fn in (gguf_fused_moe_ref, gguf_fused_moe_triton):
        with pytest.raises(UnsupportedGGUFTypeError, match="w13 is F16"):
            fn(x, w13, T.F16, w2, T.Q8_0, wts, ids)
        with pytest.raises(UnsupportedGGUFTypeError, match="w2 is IQ4_XS"):
            fn(x, w13, T.Q4_K, w2, T.IQ4_XS, wts, ids)
        with pytest.raises(ModelLoadError, match=r"w13 \(Q4_K\) must be \[E, 128, 144\] bytes"):
            fn(x, w13[..., :-1], T.Q4_K, w2, T.Q8_0, wts, ids)
        with pytest.raises(ModelLoadError, match=r"w2 \(Q8_0\) must be \[4, 256, 68\] bytes"):
            fn(x, w13, T.Q4_K, w2[:3], T.Q8_0, wts, ids)
        with pytest.raises(ModelLoadError, match=r"w2 \(Q6_K\) rows of 64 elements are not whole 256-element"):
            fn(x, w13, T.Q4_K, w2, T.Q6_K, wts, ids)
        with pytest.raises(ModelLoadError, match=r"w13 \(Q4_K\) rows of 128 elements"):
            fn(x[:, :128], w13, T.Q4_K, w2, T.Q8_0, wts, ids)
        with pytest.raises(ModelLoadError, match="w13 must be the raw blocks, uint8"):
            fn(x, w13.view(torch.int32), T.Q4_K, w2, T.Q8_0, wts, ids)
        with pytest.raises(ValueError, match="topk_ids must be"):
            fn(x, w13, T.Q4_K, w2, T.Q8_0, wts, ids.float())
        with pytest.raises(ValueError, match="unsupported activation 'relu'"):
            fn(x, w13, T.Q4_K, w2, T.Q8_0, wts, ids, "relu")


# ------------------------------------------------------------------------------------- GPU, real shapes

GPU_SHAPES = {  # E, top-k, H, I, w13 type, w2 type
    "gemma4-26b-a4b": (128, 8, 2816, 704, T.Q4_K, T.Q8_0),
    "qwen3-30b-a3b": (128, 8, 2048, 768, T.Q4_K, T.Q6_K),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_gguf_moe_gpu(model, rows):
    """The compiled kernels (the launcher's tiles, small path up to 64 pairs) against the fp32 twin of the same
    blocks on the GPU: bf16 activations (gemma4: gelu_pytorch_tanh, qwen3: silu)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    experts, top_k, hidden, width, t13, t2 = GPU_SHAPES[model]
    activation = "gelu_pytorch_tanh" if model.startswith("gemma") else "silu"
    w13, w2 = _weights(t13, t2, experts, hidden, width, "cuda")
    x, wts, ids = _routing(rows, experts, top_k, hidden, torch.bfloat16, seed=rows, device="cuda")
    got = gguf_fused_moe(x, w13, t13, w2, t2, wts, ids, activation)
    with backend("torch"):
        want = gguf_fused_moe_ref(x.float(), w13, t13, w2, t2, wts, ids, activation)
    assert got.dtype == torch.bfloat16 and nmse(got, want) <= HALF_NMSE


@pytest.mark.gpu
def test_gguf_moe_gpu_fp32_and_graph():
    """fp32 activations at gemma4's shape on both paths against the twin, and the small and grouped chains
    captured in a CUDA graph (no host sync) replaying new routing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    experts, top_k, hidden, width, t13, t2 = GPU_SHAPES["gemma4-26b-a4b"]
    w13, w2 = _weights(t13, t2, experts, hidden, width, "cuda")
    for rows in (1, 64):
        x, wts, ids = _routing(rows, experts, top_k, hidden, torch.float32, seed=rows, device="cuda")
        got = gguf_fused_moe_triton(x, w13, t13, w2, t2, wts, ids)
        with backend("torch"):
            torch.testing.assert_close(got, gguf_fused_moe_ref(x, w13, t13, w2, t2, wts, ids), **FP32_TOL)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gguf_fused_moe_triton(x, w13, t13, w2, t2, wts, ids)
        ids.copy_(_routing(rows, experts, top_k, hidden, torch.float32, seed=99, device="cuda")[2])
        graph.replay()
        torch.testing.assert_close(captured, gguf_fused_moe_triton(x, w13, t13, w2, t2, wts, ids), atol=0, rtol=0)
        assert not torch.equal(captured, got)


def bench() -> None:
    """Each GPU shape at 1 / 8 / 64 rows (bf16): time per call (CUDA graph) and GB/s of the used experts' blocks
    (plus x and the outputs) against the copy bandwidth measured here."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    from gpu_timing import copy_bandwidth, time_s

    peak = copy_bandwidth()
    print(f"copy bandwidth {peak / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})")
    for model, (experts, top_k, hidden, width, t13, t2) in sorted(GPU_SHAPES.items()):
        w13, w2 = _weights(t13, t2, experts, hidden, width, "cuda")
        for rows in (1, 8, 64):
            x, wts, ids = _routing(rows, experts, top_k, hidden, torch.bfloat16, seed=rows, device="cuda")
            used = int(torch.unique(ids).numel())
            nbytes = used * (w13[0].numel() + w2[0].numel()) + 4 * x.numel() + 4 * ids.numel() * (hidden + width)
            sec = time_s(lambda: gguf_fused_moe(x, w13, t13, w2, t2, wts, ids))
            print(f"{model} R={rows:3d}: {sec * 1e6:8.1f} us, {nbytes / sec / 1e9:7.0f} GB/s "
                  f"({100 * nbytes / sec / peak:5.1f} % of copy) for {nbytes / 1e6:.1f} MB of {used} experts")


if __name__ == "__main__":
    bench()
