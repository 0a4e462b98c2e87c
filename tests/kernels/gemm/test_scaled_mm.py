"""cuBLAS block-scaled FP8 GEMM (``sparrow.kernels.gemm.scaled_mm``): the activation quantizer against
``fp8.quantize_fp8_per_group_ref`` (CPU: Triton interpreter, exact), the cuBLAS scale layout, and on the
GPU ``fp8_scaled_mm`` / ``Fp8LinearMethod`` against the twin ``fp8_gemm_ref`` at real shapes.

Shapes: M = rows, K = input width, N = output width.
"""
import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.fp8 import AMAX_EPS, FP8_MAX, quantize_fp8_block_ref, quantize_fp8_per_group_ref
from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_ref
from sparrow.kernels.gemm.scaled_mm import (
    fp8_scaled_mm,
    quantize_fp8_per_group,
    scaled_mm_fits,
    scaled_mm_supported,
    scaled_mm_weight_scale,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _nmse(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((y.float() - ref.float()) ** 2).mean() / (ref.float() ** 2).mean())


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("rows,pad", [(1, 3), (2, 0), (3, 1), (16, 0), (17, 3), (33, 0)])
@pytest.mark.parametrize("k", [128, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m_major", [False, True])
def test_quantizer_matches_reference(rows, pad, k, dtype, m_major):
    """Triton (interpreter on CPU) and torch paths: the first M rows bit-equal to the reference (an all-zero
    group and a ragged last group included), padded rows q = 0 with the smallest scale, the asked layout."""
    torch.manual_seed(rows * 1000 + k)
    x = (torch.randn(rows, k, device=DEVICE) * 5).to(dtype)
    x[0, :128] = 0
    q_ref, s_ref = quantize_fp8_per_group_ref(x)
    m_pad = rows + pad
    for name in ("triton", "torch"):
        with backend(name):
            q, s = quantize_fp8_per_group(x, m_pad, scales_m_major=m_major)
        assert q.shape == (m_pad, k) and s.shape == (m_pad, -(-k // 128)), name
        assert s.stride() == ((1, m_pad) if m_major else (s.shape[1], 1)), name
        assert torch.equal(_bits(q[:rows]), _bits(q_ref)), name
        assert torch.equal(s[:rows], s_ref), name
        assert not _bits(q[rows:]).any(), name
        assert torch.all(s[rows:] == torch.tensor(AMAX_EPS / FP8_MAX, dtype=torch.float32)), name


def test_quantizer_rejects_bad_input():
    with pytest.raises(ValueError, match="m_pad"):
        quantize_fp8_per_group(torch.randn(4, 128), m_pad=3)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_per_group(torch.randn(4, 128).to(torch.int32))
    with pytest.raises(ValueError, match="unit stride"):
        quantize_fp8_per_group(torch.randn(128, 4).t())


@pytest.mark.parametrize("groups", [1, 4, 22, 33])
def test_weight_scale_layout(groups):
    """[NB, G] -> [L4, NB] with strides (1, L4): the scales, then ones up to a multiple of 4 in G."""
    s = torch.rand(3, groups) + 0.5
    t = scaled_mm_weight_scale(s)
    l4 = -(-groups // 4) * 4
    assert t.shape == (l4, 3) and t.stride() == (1, l4)
    assert torch.equal(t[:groups], s.t()) and torch.all(t[groups:] == 1)


def test_fits_and_cpu_refusal():
    assert scaled_mm_fits(2816, 8192) and scaled_mm_fits(4096, 2816) and scaled_mm_fits(2112, 2816)
    assert not scaled_mm_fits(300, 2816) and not scaled_mm_fits(128, 40)
    x = torch.randn(4, 128)
    wq, ws = quantize_fp8_block_ref(torch.randn(32, 128))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_scaled_mm(torch.randn(4, 300), *quantize_fp8_block_ref(torch.randn(32, 300)))
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_scaled_mm(x, wq, scaled_mm_weight_scale(ws), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be"):
        fp8_scaled_mm(x.to(torch.int64), wq, scaled_mm_weight_scale(ws))
    with pytest.raises(ValueError, match="scaled_mm_weight_scale"):
        fp8_scaled_mm(x, wq, ws)  # the checkpoint layout, not cuBLAS's
    if not scaled_mm_supported(x.device):
        with pytest.raises(RuntimeError, match="not available"):
            fp8_scaled_mm(x, wq, scaled_mm_weight_scale(ws))


def _require_cublas_fp8() -> None:
    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip(f"cuBLAS block-scaled FP8 needs compute capability 9.x and CUDA >= 12.9 (torch {torch.__version__})")


# Both sides quantize x identically (per 128-group, the same formula), so only the fp32 summation order and
# the bf16 output rounding (<= 2^-8 relative, NMSE ~ 1e-6) differ.
GPU_NMSE = 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 33, 64, 65, 257, 2048])
@pytest.mark.parametrize("k,n", [(2816, 8192), (4096, 2816), (2816, 4224), (2112, 2816), (256, 48), (144, 32)])
def test_gpu_scaled_mm_real_shapes(rows, k, n):
    _require_cublas_fp8()
    torch.manual_seed(rows + k + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_fp8_block_ref(torch.randn(n, k, device="cuda") / k**0.5)
    y = fp8_scaled_mm(x, wq, scaled_mm_weight_scale(ws))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert _nmse(y, fp8_gemm_ref(x, wq, ws)) <= GPU_NMSE


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 17, 64, 65, 300])
@pytest.mark.parametrize("k,n", [(2816, 4224), (2816, 8192)])
def test_gpu_fp8_linear_formula_by_rows(rows, k, n):
    """An on-load FP8 Linear on the GPU, Triton / cuBLAS path against ``backend("torch")`` on the same device
    (which must pick the same formula), and against the W8A8 twin where the formula is W8A8: up to 16 rows,
    above 64, and where cuBLAS's block-scaled GEMM runs from ``scaled_mm_min_rows`` (17 for the 23 M-element
    weight, 65 for the 12 M one)."""
    from sparrow.kernels.gemm.gemv import FP8_MAX_ROWS, W8A8_MAX_ROWS
    from sparrow.layers.linear import Linear
    from sparrow.quant.fp8 import Fp8LinearMethod, scaled_mm_min_rows

    torch.manual_seed(rows)
    with torch.device("cuda"):
        layer = Linear(k, n, bias=False, dtype=torch.bfloat16)
    layer.set_quant_method(Fp8LinearMethod(from_checkpoint=False))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    layer.weight.weight_loader(layer.weight, w, None, "w")
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.scaled_mm_scale is not None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    with backend("torch"):
        twin = layer(x)
    assert _nmse(y, twin) <= 5e-5
    cublas = scaled_mm_supported(torch.device("cuda"))  # else 17-64 rows stay W8A16 at every shape
    w8a8 = rows <= W8A8_MAX_ROWS or rows > FP8_MAX_ROWS or (cublas and rows >= scaled_mm_min_rows(layer))
    assert scaled_mm_min_rows(layer) == (17 if n == 8192 else 65)
    if w8a8:
        assert _nmse(y, fp8_gemm_ref(x, layer.weight, layer.weight_scale_inv)) <= 5e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64])
def test_gpu_scaled_mm_in_cuda_graph(rows):
    """Decode batches past 16 rows run the quantizer + cuBLAS GEMM inside captured decode graphs: a replay on new
    inputs gives the twin's numbers for those inputs."""
    _require_cublas_fp8()
    torch.manual_seed(rows)
    k, n = 2816, 8192
    wq, ws = quantize_fp8_block_ref(torch.randn(n, k, device="cuda") / k**0.5)
    ws_mm = scaled_mm_weight_scale(ws)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    fp8_scaled_mm(x, wq, ws_mm)  # warm up outside the capture (cuBLAS picks its algorithm, workspaces)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_scaled_mm(x, wq, ws_mm)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _nmse(y, fp8_gemm_ref(x, wq, ws)) <= GPU_NMSE
