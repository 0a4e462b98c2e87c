"""Programmatic dependent launch (sparrow.kernels.use_pdl, _pdl_jit.pdl_enter): off on CPU and under the
interpreter; on the GPU a chain of dependent kernels launched with it gives bit-identical results to plain
launches, eagerly and replayed from a CUDA graph."""
import pytest
import torch

import sparrow.kernels as K
from sparrow import switches
from sparrow.kernels.activation.act import gelu_tanh_and_mul_triton
from sparrow.kernels.norm_rope.norm import rms_norm_triton


def test_off_without_a_hopper_gpu(monkeypatch):
    x = torch.zeros(4)
    monkeypatch.setattr(switches, "PDL", True)
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


def _same_as_plain_launches(run, x) -> None:
    """``run()`` with PDL off (``switches.PDL``) gives the reference; with PDL on it must give the same bits,
    eagerly and replayed from a CUDA graph."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    old = switches.PDL
    try:
        switches.PDL = False
        want = run()
        switches.PDL = True
        assert K.use_pdl(x)
        torch.testing.assert_close(run(), want, atol=0, rtol=0)  # also compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.testing.assert_close(out, want, atol=0, rtol=0)
    finally:
        switches.PDL = old


@pytest.mark.gpu
def test_gpu_pdl_chain_matches_plain_launches():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2816, device="cuda", generator=g).bfloat16()
    w = torch.rand(2816, device="cuda", generator=g).bfloat16()
    _same_as_plain_launches(lambda: _chain(x, w, 40), x)


def _weights_chain(x, w8, s8, w16, experts, steps):
    """Weight kernels under PDL: W8A8 GEMV, bf16 GEMV, the MoE small path, each reading the previous output."""
    from sparrow.kernels.gemm.gemv import gemv_triton, gemv_w8a8_triton
    from sparrow.kernels.moe.moe import fused_moe_triton

    gate_up, down, topk_w, topk_ids = experts
    y = x
    for _ in range(steps):
        y = gemv_w8a8_triton(y, w8, s8)
        y = gemv_triton(y, w16)
        y = fused_moe_triton(y, gate_up, down, topk_w, topk_ids, "gelu_pytorch_tanh")
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_gpu_norm_chain_early_loads_change_no_result(rows):
    """The norm chain reads its weights and layer scalar before the PDL wait and its addends (pre_add, post_add,
    residual) right after it: every step's inputs are the previous launches' outputs, and the bits equal plain
    launches'."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2816, device="cuda", generator=g).bfloat16()
    w = torch.rand(2816, device="cuda", generator=g).bfloat16()
    w2 = torch.rand(2816, device="cuda", generator=g).bfloat16()
    scale = torch.full((1,), 0.75, device="cuda").bfloat16()

    def run():
        outs = []
        y, h = x, x
        for _ in range(8):
            y, n1, n2 = rms_norm_triton(y, w, 1e-6, gemma=True, unit_offset=False, post_add=h, post_scale=scale,
                                        pre_weight=w2, pre_add=n1 if outs else x, pre_add_weight=w,
                                        next_weights=(w2, w))
            n2, h = rms_norm_triton(n2, w2, 1e-6, gemma=True, unit_offset=False, residual=y)
            outs += [n1, n2]
            y = n2
        return torch.cat(outs, dim=1).float()

    _same_as_plain_launches(run, x)


@pytest.mark.gpu
def test_gpu_weight_kernels_match_plain_launches():
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    h, e, i = 1024, 16, 256
    x = torch.randn(2, h, device="cuda", generator=g).bfloat16()
    w8, s8 = quantize_fp8_block_ref(torch.randn(h, h, device="cuda", generator=g) / h**0.5)
    w16 = (torch.randn(h, h, device="cuda", generator=g) / h**0.5).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).bfloat16()
    topk_w, topk_ids = torch.softmax(torch.randn(2, e, device="cuda", generator=g), -1).topk(4)
    experts = (gate_up, down, topk_w, topk_ids.to(torch.int32))
    _same_as_plain_launches(lambda: _weights_chain(x, w8, s8, w16, experts, 10), x)
