"""Programmatic dependent launch (sparrow.kernels.use_pdl, _pdl_jit.pdl_enter): off on CPU and under the
interpreter; on the GPU a chain of dependent kernels launched with it gives bit-identical results to plain
launches, eagerly and replayed from a CUDA graph."""
import pytest
import torch

import sparrow.kernels as K
from sparrow.kernels.act import gelu_tanh_and_mul_triton
from sparrow.kernels.norm import rms_norm_triton


def test_off_without_a_hopper_gpu():
    x = torch.zeros(4)
    assert not K.use_pdl(x)
    assert K.pdl_kwargs(x) == {"USE_PDL": False, "launch_pdl": False}


def _chain(x, w, steps):
    """4 x steps launches, each reading the previous one's output: three PDL kernels in a row (norm, norm,
    act_and_mul), then a plain torch launch (cat)."""
    y = x
    for _ in range(steps):
        y = rms_norm_triton(y, w, 1e-6, gemma=True, unit_offset=False, post_add=x)
        a = gelu_tanh_and_mul_triton(rms_norm_triton(y, w, 1e-6, gemma=True, unit_offset=False))
        y = torch.cat([a, a], dim=-1)
    return y


@pytest.mark.gpu
def test_gpu_pdl_chain_matches_plain_launches():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2816, device="cuda", generator=g).bfloat16()
    w = torch.rand(2816, device="cuda", generator=g).bfloat16()
    old = K.PDL
    try:
        K.PDL = False
        want = _chain(x, w, 40)
        K.PDL = True
        assert K.use_pdl(x)
        torch.testing.assert_close(_chain(x, w, 40), want, atol=0, rtol=0)
        _chain(x, w, 40)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, w, 40)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.testing.assert_close(out, want, atol=0, rtol=0)
    finally:
        K.PDL = old
