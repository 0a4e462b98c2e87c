"""Gated activations: the Triton launchers against their torch twins (R = rows, I = intermediate width).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py). Run as a script on a GPU for GB/s.
"""
import pytest
import torch
import torch.nn.functional as F

from sparrow.kernels import backend
from sparrow.kernels.activation.act import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)

# exp(-2z) overflows to inf for very negative gates under the interpreter (numpy warns); the result is exact.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 16, 17, 33]
INTER = [40, 136, 640, 1000]
DTYPES = [torch.float32, torch.bfloat16]
# fp32: exp-based sigmoid / tanh vs torch's intrinsics, a few fp32 ulps; bf16: one output rounding
# (Triton 3.9's interpreter truncates fp32 -> bf16, so on CPU up to one bf16 ulp).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
PAIRS = {"silu": (silu_and_mul_triton, silu_and_mul_ref), "gelu_tanh": (gelu_tanh_and_mul_triton, gelu_tanh_and_mul_ref)}


def _x(rows, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", list(PAIRS))
def test_kernel_matches_twin(name, rows, inter, dtype):
    kernel, twin = PAIRS[name]
    x = _x(rows, inter, dtype)
    torch.testing.assert_close(kernel(x), twin(x), **TOL[dtype])


@pytest.mark.parametrize("name", list(PAIRS))
def test_extreme_gates_and_strided_rows(name):
    kernel, twin = PAIRS[name]
    x = _x(3, 40, torch.float32)
    x[0, :40] = torch.linspace(-200, 200, 40)  # exp over/underflow at both tails stays finite
    wide = torch.zeros(3, 100, device=DEVICE)
    wide[:, :80] = x
    view = wide[:, :80]  # row stride 100 > 2I
    got = kernel(view)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, twin(x), **TOL[torch.float32])


def test_twins_match_hf_formulas():
    x = _x(4, 136, torch.float32)
    gate, up = x[:, :136], x[:, 136:]
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(gate) * up, atol=0, rtol=0)
    tanh_form = 0.5 * gate * (1 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), tanh_form, atol=1e-5, rtol=1e-5)


def test_dispatcher_and_force():
    x = _x(2, 40, torch.float32)
    with backend("triton"):
        torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[torch.float32])
        torch.testing.assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x), **TOL[torch.float32])
        assert silu_and_mul(x[:0]).shape == (0, 40)


@pytest.mark.parametrize(
    "bad", [lambda: torch.zeros(2, 41), lambda: torch.zeros(2, 40, dtype=torch.int32), lambda: torch.zeros(40, 2).t()]
)
def test_launcher_rejects(bad):
    with pytest.raises(ValueError, match="silu_and_mul"):
        silu_and_mul_triton(bad())


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [704, 2112, 5632])
@pytest.mark.parametrize("rows", [1, 8, 64, 1024])
@pytest.mark.parametrize("name", list(PAIRS))
def test_gpu_real_shapes(name, rows, inter):
    kernel, twin = PAIRS[name]
    x = _x(rows, inter, torch.bfloat16)
    torch.testing.assert_close(kernel(x), twin(x), **TOL[torch.bfloat16])


if __name__ == "__main__":
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    import kernels_micro

    kernels_micro.main(["act"])
