"""Fused router kernel against its torch twin (``select_experts``).

Shapes: R = rows, E = experts, K = top-k. Ids are compared as sets per row (the kernel breaks ties by the
lowest id, torch.topk by its own order; random fp32 logits have no ties), weights matched by id with
atol 1e-6 (fp32; only the order of the softmax sum differs). On CPU the kernel runs under
TRITON_INTERPRET=1. Run as a script on a GPU for the time per call.
"""
import pytest
import torch

from sparrow.kernels.moe.router import (
    LogitsConfig,
    forced_logits_config,
    fused_router,
    fused_router_ref,
    fused_router_triton,
    router_logits,
    router_logits_ref,
    router_logits_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 16, 17, 64, 65]

# name -> (kwargs of select_experts beyond top_k, needs bias): one per routing family
FAMILIES = {
    "mixtral": dict(scoring="softmax", renormalize=True),
    "qwen_no_norm": dict(scoring="softmax", renormalize=False),
    "gemma4": dict(scoring="softmax", renormalize=True, per_expert_scale=True),
    "deepseek_v3": dict(scoring="sigmoid", renormalize=True, bias=True, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5),
    "minimax_m2": dict(scoring="sigmoid", renormalize=True, bias=True),
    "deepseek_v4": dict(scoring="sqrtsoftplus", renormalize=True, bias=True, routed_scaling_factor=1.5),
}


def _args(family, num_experts, rows, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kw = dict(FAMILIES[family])
    logits = (torch.randn(rows, num_experts, generator=g) * 2).to(dtype).to(DEVICE)
    if kw.pop("bias", False):
        kw["e_score_correction_bias"] = (torch.rand(num_experts, generator=g) * 0.1).to(DEVICE)
    if kw.pop("per_expert_scale", False):
        kw["per_expert_scale"] = (torch.rand(num_experts, generator=g) + 0.5).to(DEVICE)
    return logits, kw


def _assert_same_routing(got, want):
    (w1, i1), (w2, i2) = got, want
    assert w1.shape == w2.shape and w1.dtype == torch.float32 and i1.shape == i2.shape
    o1, o2 = i1.long().sort(dim=1), i2.long().sort(dim=1)
    torch.testing.assert_close(o1.values, o2.values, atol=0, rtol=0)  # same ids as sets
    torch.testing.assert_close(w1.gather(1, o1.indices), w2.gather(1, o2.indices), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (64, 8), (128, 8)])
def test_router_matches_select_experts(family, num_experts, top_k):
    if family == "deepseek_v3" and num_experts == 8:
        pytest.skip("8 groups of 1 expert: covered by test_grouped_edge_cases")
    # every row count at E = 128 for the flagship's router, 1 / 17 / 65 for the other scoring functions;
    # the interpreter pays per row
    rows_list = ROWS if (num_experts, family) == (128, "gemma4") else [1, 17, 65] if num_experts == 128 else [1, 17]
    for rows in rows_list:
        logits, kw = _args(family, num_experts, rows, seed=rows)
        _assert_same_routing(fused_router_triton(logits, top_k, **kw), fused_router_ref(logits, top_k, **kw))


@pytest.mark.parametrize("n_group,topk_group,top_k", [(8, 1, 2), (8, 8, 8), (4, 2, 3), (64, 3, 3), (3, 2, 5)])
def test_grouped_edge_cases(n_group, topk_group, top_k):
    num_experts = 48 if n_group == 3 else 64  # 3 groups of 16: non-power-of-two group count
    logits, kw = _args("deepseek_v3", num_experts, 17)
    kw.update(n_group=n_group, topk_group=topk_group)
    _assert_same_routing(fused_router_triton(logits, top_k, **kw), fused_router_ref(logits, top_k, **kw))


def test_odd_experts_bf16_logits_int32_ids_and_dispatch():
    logits, kw = _args("minimax_m2", 60, 5, dtype=torch.bfloat16)  # E not a power of two, bf16 input
    got = fused_router_triton(logits, 4, ids_dtype=torch.int32, **kw)
    assert got[1].dtype == torch.int32
    _assert_same_routing(got, fused_router_ref(logits, 4, **kw))
    w, i = fused_router(logits, 4, **kw)  # CPU tensor: the twin
    assert i.dtype == torch.int64
    wide = torch.zeros(5, 100, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :60] = logits
    _assert_same_routing(fused_router_triton(wide[:, :60], 4, **kw), (w, i))  # strided rows
    assert fused_router_triton(logits[:0], 4, **kw)[0].shape == (0, 4)


def test_extreme_logits_sqrtsoftplus():
    logits = torch.tensor([[-40.0, -10.0, -1e-3, 0.0, 5.0, 19.9, 20.1, 60.0]], device=DEVICE)
    for renorm in (False, True):
        got = fused_router_triton(logits, 8, "sqrtsoftplus", renormalize=renorm)
        _assert_same_routing(got, fused_router_ref(logits, 8, "sqrtsoftplus", renormalize=renorm))


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda x: fused_router_triton(x, 0), "top_k"),
        (lambda x: fused_router_triton(x, 2, "relu"), "scoring"),
        (lambda x: fused_router_triton(x[0], 2), "2-D"),
        (lambda x: fused_router_triton(x, 2, n_group=4), "n_group"),
        (lambda x: fused_router_triton(x, 2, n_group=3, topk_group=1), "inconsistent"),
        (lambda x: fused_router_triton(x, 2, e_score_correction_bias=torch.zeros(7)), "e_score_correction_bias"),
        (lambda x: fused_router_triton(x, 2, ids_dtype=torch.int16), "ids_dtype"),
    ],
)
def test_launcher_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(torch.randn(3, 8, device=DEVICE))


def _logit_args(rows, num_experts, hidden, x_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(x_dtype).to(DEVICE)
    w = (torch.randn(num_experts, hidden, generator=g) / hidden**0.5).to(DEVICE)
    return x, w


@pytest.mark.parametrize("rms_eps", [None, 1e-6])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,num_experts,hidden", [(1, 8, 64), (2, 128, 200), (3, 6, 96), (16, 128, 64), (64, 16, 64),
                                                     (17, 6, 200), (33, 40, 96), (2, 6, 2816), (16, 8, 300)])
def test_router_logits_kernel_matches_twin(rows, num_experts, hidden, x_dtype, rms_eps):
    """fp32 logits (with Gemma 4's scale-free norm folded in) within fp32 rounding-order error of the twin; H in
    one step and in several (the last two shapes)."""
    x, w = _logit_args(rows, num_experts, hidden, x_dtype)
    got, want = router_logits_triton(x, w, rms_eps), router_logits_ref(x, w, rms_eps)
    assert got.dtype == torch.float32 and got.shape == (rows, num_experts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rms_eps", [None, 1e-6])
@pytest.mark.parametrize("rows,num_experts,hidden", [(17, 6, 200), (33, 40, 96), (64, 16, 300)])
@pytest.mark.parametrize("config", [LogitsConfig(16, 4, 32, split_k=3), LogitsConfig(32, 8, 64, split_k=0),
                                    LogitsConfig(16, 2, 0)])
def test_router_logits_expert_tiles_and_split_k(rows, num_experts, hidden, rms_eps, config):
    """Expert tiles (ragged against E), H split over programs and reduced in the kernel (3 uneven ranges, some
    empty at small H; automatic; none), the norm's sum of squares reduced with the dot. Twice, for the
    counters' reset and a deterministic sum."""
    x, w = _logit_args(rows, num_experts, hidden, torch.bfloat16, seed=rows)
    with forced_logits_config(config):
        got, again = router_logits_triton(x, w, rms_eps), router_logits_triton(x, w, rms_eps)
    torch.testing.assert_close(got, router_logits_ref(x, w, rms_eps), atol=1e-5, rtol=1e-5)
    assert torch.equal(got, again)


def test_router_logits_bf16_weight_and_dispatch():
    x, w = _logit_args(3, 8, 64, torch.bfloat16)
    wb = w.to(torch.bfloat16)
    torch.testing.assert_close(router_logits_triton(x, wb), router_logits_ref(x, wb), atol=1e-5, rtol=1e-5)
    from sparrow.kernels import backend
    from sparrow.kernels.moe.router import MAX_LOGIT_ROWS

    big, _ = _logit_args(MAX_LOGIT_ROWS + 1, 8, 64, torch.float32)
    with backend("triton"):  # above MAX_LOGIT_ROWS the dispatcher keeps torch's matmul: the twin exactly
        assert torch.equal(router_logits(big, w, 1e-6), router_logits_ref(big, w, 1e-6))
    with pytest.raises(ValueError, match="need x"):
        router_logits_triton(x, w[:, :32])
    xs = torch.cat([x, x], dim=1)[:, ::2]  # a strided x is copied, not rejected
    torch.testing.assert_close(router_logits_triton(xs, wb), router_logits_ref(xs, wb), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_gemma4_router_backends_agree(rows):
    """``Gemma4Router`` on the Triton path (``router_topk``: the logits kernel, or torch's matmul above
    MAX_LOGIT_ROWS, then the routing kernel) routes as its torch path does."""
    from sparrow.kernels import backend
    from sparrow.layers.router import Gemma4Router

    g = torch.Generator().manual_seed(rows)
    router = Gemma4Router(64, 16, 4, params_dtype=torch.bfloat16).to(DEVICE)
    router.proj.weight.copy_(torch.randn(16, 64, generator=g))
    router.scale.copy_(torch.rand(64, generator=g) + 0.5)
    router.per_expert_scale.copy_(torch.rand(16, generator=g) + 0.5)
    x = (torch.randn(rows, 64, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    with backend("torch"):
        want = router(x)
    with backend("triton"):
        got = router(x)
    assert got[1].dtype == want[1].dtype == torch.int64
    _assert_same_routing(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 64, 100, 256])
@pytest.mark.parametrize("rms_eps", [None, 1e-6])
def test_gpu_router_logits_real_shape(rows, rms_eps):
    x, w = _logit_args(rows, 128, 2816, torch.bfloat16)
    torch.testing.assert_close(router_logits_triton(x, w, rms_eps), router_logits_ref(x, w, rms_eps),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("rows", [1, 64, 1024, 8192])
def test_gpu_real_shapes(family, rows):
    num_experts = 256 if family.startswith("deepseek") else 128
    logits, kw = _args(family, num_experts, rows)
    _assert_same_routing(fused_router_triton(logits, 8, **kw), fused_router_ref(logits, 8, **kw))


if __name__ == "__main__":
    import triton.testing

    for family in FAMILIES:
        for rows in (1, 64, 1024, 8192):
            num_experts = 256 if family.startswith("deepseek") else 128
            logits, kw = _args(family, num_experts, rows)
            t = triton.testing.do_bench_cudagraph(lambda: fused_router_triton(logits, 8, **kw), rep=50)
            t_ref = triton.testing.do_bench_cudagraph(lambda: fused_router_ref(logits, 8, **kw), rep=50)
            print(f"router {family:<13} E={num_experts:<4} rows={rows:<5} triton {t * 1e3:8.2f} us   "
                  f"torch {t_ref * 1e3:8.2f} us   {logits.numel() * 4 / (t * 1e-3) / 1e9:7.1f} GB/s (logits read)")
