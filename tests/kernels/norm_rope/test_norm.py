"""RMSNorm: the torch twin against transformers' modules, the Triton launcher against the twin.

Shapes: R = rows, H = hidden, nH = heads, D = head dim. On CPU the Triton kernel runs under
TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small. Run as a script on a GPU for GB/s.
"""
import os

import numpy as np
import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.norm_rope.norm import rms_norm, rms_norm_ref, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 16, 17, 33]
HIDDEN = [40, 136, 640, 1000]
DTYPES = [torch.float32, torch.bfloat16]
# Kernel vs twin: the same fp32 math, only the reduction order (and GPU rsqrt) differ, so at most one
# rounding step of the output dtype apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
CONVENTIONS = {"llama": dict(gemma=False), "gemma3": dict(gemma=True), "gemma4": dict(gemma=True, unit_offset=False)}


@pytest.fixture(scope="module", autouse=True)
def interpreter_rounds_like_gpu():
    """Triton 3.9's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even) and drops the
    mantissa carry in fp32 -> e4m3 (1.95 becomes 1.0, not 2.0). While this module runs, do those two
    casts with torch's round-to-nearest-even, as the GPU does, so the comparisons stay tight."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def from_fp32(src, dst_type, torch_dtype, np_dtype):
        t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch_dtype)
        return ti.TensorHandle(t.view(np_dtype[0]).numpy().view(np_dtype[1]), dst_type.scalar)

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return from_fp32(src, dst_type, torch.bfloat16, (torch.int16, np.uint16))
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return from_fp32(src, dst_type, torch.float8_e4m3fn, (torch.uint8, np.uint8))
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl, builder.create_fp_to_fp = patched_cast, patched_fp_to_fp  # create_fp_trunc calls cast_impl
    yield
    builder.cast_impl, builder.create_fp_to_fp = cast_impl, fp_to_fp


def _inputs(rows, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)
    w = (torch.rand(hidden, generator=g) * 2 - 0.5).to(dtype).to(DEVICE)
    return x, w


# ---- the twin against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_matches_hf_modules(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w = _inputs(5, 136, dtype)
    x, w = x.cpu(), w.cpu()
    eps = 1e-6
    cases = [
        (LlamaRMSNorm(136, eps=eps), dict(gemma=False), w),
        (Gemma3RMSNorm(136, eps=eps), dict(gemma=True), w),
        (Gemma4RMSNorm(136, eps=eps), dict(gemma=True, unit_offset=False), w),
        (Gemma4RMSNorm(136, eps=eps, with_scale=False), dict(gemma=True), None),
    ]
    for module, kw, weight in cases:
        module = module.to(dtype)
        if weight is not None:
            module.weight.data.copy_(weight)
        with torch.no_grad():
            expect = module(x)
        got = rms_norm_ref(x, weight, eps, **kw)
        # Same ops in the same order: bit-exact (Gemma 4's pow(-0.5) vs rsqrt may differ by 1 fp32 ulp).
        torch.testing.assert_close(got, expect, atol=0, rtol=1e-6 if dtype == torch.float32 else 0)


def test_twin_residual_matches_hf_add_then_norm():
    x, w = _inputs(4, 40, torch.bfloat16)
    r, _ = _inputs(4, 40, torch.bfloat16, seed=1)
    y, new_res = rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(new_res, x + r, atol=0, rtol=0)  # the sum is rounded to bf16 like HF's
    torch.testing.assert_close(y, rms_norm_ref(x + r, w, 1e-6), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_post_add_and_scale_match_the_sandwich_norm_ops(dtype):
    """``post_add`` / ``post_scale`` equal transformers' ``b + norm(x)`` then ``* layer_scalar`` in x's dtype."""
    x, w = _inputs(4, 40, dtype)
    b, _ = _inputs(4, 40, dtype, seed=1)
    s = torch.tensor([0.37], dtype=dtype)
    kw = CONVENTIONS["gemma4"]
    y = rms_norm_ref(x, w, 1e-6, **kw)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, post_add=b, **kw), b + y, atol=0, rtol=0)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, post_add=b, post_scale=s, **kw), (b + y) * s, atol=0, rtol=0)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, post_scale=s, **kw), y * s, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_pre_norm_is_two_sandwich_norms(dtype):
    """``pre_weight`` / ``pre_add`` equal ``norm_add`` twice: Gemma 4's post_feedforward_layernorm_2 sum, then
    post_feedforward_layernorm with the residual and layer_scalar, each rounding as transformers does."""
    x, w = _inputs(4, 40, dtype)
    a, w2 = _inputs(4, 40, dtype, seed=1)
    b, _ = _inputs(4, 40, dtype, seed=2)
    s = torch.tensor([0.37], dtype=dtype)
    kw = CONVENTIONS["gemma4"]
    t = rms_norm_ref(x, w2, 1e-6, post_add=a, **kw)
    want = rms_norm_ref(t, w, 1e-6, post_add=b, post_scale=s, **kw)
    got = rms_norm_ref(x, w, 1e-6, post_add=b, post_scale=s, pre_weight=w2, pre_add=a, **kw)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_norm_chain_is_the_norms_one_by_one(dtype):
    """``pre_add_weight`` normalizes pre_add first and ``next_weights`` appends norms of the output: the same
    values as separate twin calls (Gemma 4's post_feedforward_layernorm_1 / _2 sum, then
    post_feedforward_layernorm, then the next layer's input_layernorm; or post_attention_layernorm then both
    pre_feedforward_layernorms)."""
    x, w = _inputs(4, 40, dtype)
    a, w2 = _inputs(4, 40, dtype, seed=1)
    b, w3 = _inputs(4, 40, dtype, seed=2)
    _, w4 = _inputs(4, 40, dtype, seed=3)
    _, w5 = _inputs(4, 40, dtype, seed=4)
    s = torch.tensor([0.37], dtype=dtype)
    kw = CONVENTIONS["gemma4"]
    a_normed = rms_norm_ref(a, w3, 1e-6, **kw)
    y = rms_norm_ref(x, w, 1e-6, post_add=b, post_scale=s, pre_weight=w2, pre_add=a_normed, **kw)
    got = rms_norm_ref(x, w, 1e-6, post_add=b, post_scale=s, pre_weight=w2, pre_add=a, pre_add_weight=w3,
                       next_weights=(w4, w5), **kw)
    for g, want in zip(got, (y, rms_norm_ref(y, w4, 1e-6, **kw), rms_norm_ref(y, w5, 1e-6, **kw))):
        torch.testing.assert_close(g, want, atol=0, rtol=0)
    y1 = rms_norm_ref(x, w, 1e-6, post_add=b, **kw)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, post_add=b, next_weights=(w4,), **kw)[1],
                               rms_norm_ref(y1, w4, 1e-6, **kw), atol=0, rtol=0)


def test_twin_pair_weights_are_moe_reduce_first():
    """``pair_weights``: x [R K, H] is reduced exactly as moe_reduce_ref before the norm chain."""
    from sparrow.kernels.moe.moe import moe_reduce_ref

    pairs, w = _inputs(12, 40, torch.bfloat16)
    weights = torch.rand(4, 3)
    b, w2 = _inputs(4, 40, torch.bfloat16, seed=1)
    kw = CONVENTIONS["gemma4"]
    got = rms_norm_ref(pairs, w, 1e-6, post_add=b, pair_weights=weights, next_weights=(w2,), **kw)
    want = rms_norm_ref(moe_reduce_ref(pairs, weights), w, 1e-6, post_add=b, next_weights=(w2,), **kw)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=0, rtol=0)


# ---- the Triton kernel against the twin --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_llama(rows, hidden, dtype):
    x, w = _inputs(rows, hidden, dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", ["gemma3", "gemma4"])
@pytest.mark.parametrize("rows,hidden", [(1, 40), (3, 1000), (17, 136)])
def test_kernel_gemma(rows, hidden, convention, dtype):
    x, w = _inputs(rows, hidden, dtype)
    kw = CONVENTIONS[convention]
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6, **kw), rms_norm_ref(x, w, 1e-6, **kw), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 40), (16, 640), (33, 1000)])
def test_kernel_scale_free(rows, hidden, dtype):
    x, _ = _inputs(rows, hidden, dtype)
    torch.testing.assert_close(rms_norm_triton(x, None, 1e-6), rms_norm_ref(x, None, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", ["llama", "gemma3"])
@pytest.mark.parametrize("rows,hidden", [(1, 136), (2, 40), (17, 1000), (33, 640)])
def test_kernel_residual(rows, hidden, convention, dtype):
    x, w = _inputs(rows, hidden, dtype)
    r, _ = _inputs(rows, hidden, dtype, seed=1)
    kw = CONVENTIONS[convention]
    y, new_res = rms_norm_triton(x, w, 1e-6, residual=r, **kw)
    y_ref, new_res_ref = rms_norm_ref(x, w, 1e-6, residual=r, **kw)
    torch.testing.assert_close(new_res, new_res_ref, atol=0, rtol=0)  # one rounding of an fp32 sum
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 136), (3, 1000), (17, 40)])
def test_kernel_post_add_and_scale(rows, hidden, with_scale, dtype):
    x, w = _inputs(rows, hidden, dtype)
    b, _ = _inputs(rows, hidden, dtype, seed=1)
    s = torch.tensor([1.7], dtype=dtype, device=DEVICE) if with_scale else None
    kw = CONVENTIONS["gemma4"]
    got = rms_norm_triton(x, w, 1e-6, post_add=b, post_scale=s, **kw)
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6, post_add=b, post_scale=s, **kw), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", ["gemma4", "llama"])
@pytest.mark.parametrize("rows,hidden", [(1, 136), (3, 1000), (17, 40)])
def test_kernel_pre_norm(rows, hidden, convention, dtype):
    x, w = _inputs(rows, hidden, dtype)
    a, w2 = _inputs(rows, hidden, dtype, seed=1)
    b, _ = _inputs(rows, hidden, dtype, seed=2)
    s = torch.tensor([1.7], dtype=dtype, device=DEVICE)
    kw = dict(CONVENTIONS[convention], post_add=b, post_scale=s, pre_weight=w2, pre_add=a)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6, **kw), rms_norm_ref(x, w, 1e-6, **kw), **TOL[dtype])


def test_pre_norm_rejects():
    x, w = _inputs(2, 40, torch.float32)
    with pytest.raises(ValueError, match="go together"):
        rms_norm_triton(x, w, 1e-6, pre_weight=w)
    with pytest.raises(ValueError, match="pre_add"):
        rms_norm_triton(x, w, 1e-6, pre_weight=w, pre_add=x[:1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", ["gemma4", "llama", "gemma3"])
@pytest.mark.parametrize("rows,hidden", [(1, 136), (3, 1000), (17, 40)])
@pytest.mark.parametrize("pre", [False, True])
@pytest.mark.parametrize("num_next", [1, 2])
def test_kernel_norm_chain(rows, hidden, convention, dtype, pre, num_next):
    """pre_add_weight and next_weights (1 or 2) in one launch, against the twin."""
    x, w = _inputs(rows, hidden, dtype)
    a, w2 = _inputs(rows, hidden, dtype, seed=1)
    b, w3 = _inputs(rows, hidden, dtype, seed=2)
    nexts = tuple(_inputs(rows, hidden, dtype, seed=3 + i)[1] for i in range(num_next))
    kw = dict(CONVENTIONS[convention], post_add=b, next_weights=nexts)
    if pre:
        kw.update(pre_weight=w2, pre_add=a, pre_add_weight=w3, post_scale=torch.tensor([1.7], dtype=dtype, device=DEVICE))
    got, ref = rms_norm_triton(x, w, 1e-6, **kw), rms_norm_ref(x, w, 1e-6, **kw)
    assert len(got) == len(ref) == 1 + num_next
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,top_k,hidden", [(1, 8, 136), (3, 2, 1000), (5, 1, 40)])
def test_kernel_pair_weights(rows, top_k, hidden, dtype):
    """The experts' weighted reduce fused in front of the whole Gemma 4 closing chain."""
    pairs, w = _inputs(rows * top_k, hidden, dtype)
    weights = torch.rand(rows, top_k, device=DEVICE)
    a, w2 = _inputs(rows, hidden, dtype, seed=1)
    b, w3 = _inputs(rows, hidden, dtype, seed=2)
    kw = dict(CONVENTIONS["gemma4"], post_add=b, post_scale=torch.tensor([0.7], dtype=dtype, device=DEVICE),
              pre_weight=w2, pre_add=a, pre_add_weight=w3, next_weights=(w,), pair_weights=weights)
    for g, r in zip(rms_norm_triton(pairs, w, 1e-6, **kw), rms_norm_ref(pairs, w, 1e-6, **kw)):
        assert g.shape == (rows, hidden)
        torch.testing.assert_close(g, r, **TOL[dtype])


def test_norm_chain_rejects():
    x, w = _inputs(2, 40, torch.float32)
    with pytest.raises(ValueError, match="pre_add_weight needs pre_add"):
        rms_norm_triton(x, w, 1e-6, pre_add_weight=w)
    with pytest.raises(ValueError, match="at most 2 next_weights"):
        rms_norm_triton(x, w, 1e-6, next_weights=(w, w, w))
    with pytest.raises(ValueError, match="next_weights need"):
        rms_norm_triton(x.view(2, 2, 20), w[:20], 1e-6, next_weights=(w[:20],))
    with pytest.raises(ValueError, match="next_weights entry"):
        rms_norm_triton(x, w, 1e-6, next_weights=(w[:4],))
    with pytest.raises(ValueError, match="pair_weights must be"):
        rms_norm_triton(x, w, 1e-6, pair_weights=torch.ones(3, 1))  # 2 rows are not 3 x 1 pairs
    with pytest.raises(ValueError, match="post_add"):
        rms_norm_triton(x, w, 1e-6, post_add=x, pair_weights=torch.ones(1, 2))  # post_add must be [1, H]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", ["llama", "gemma4"])
@pytest.mark.parametrize("rows,heads,head_dim", [(1, 2, 40), (3, 4, 64), (17, 2, 136)])
def test_kernel_per_head_strided(rows, heads, head_dim, convention, dtype):
    # q_norm over a view of a fused qkv output: row stride > heads * head_dim.
    qkv, w = _inputs(rows, (heads + 2) * head_dim, dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    w = w[:head_dim].contiguous()
    kw = CONVENTIONS[convention]
    got = rms_norm_triton(q, w, 1e-6, **kw)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm_ref(q, w, 1e-6, **kw), **TOL[dtype])
    torch.testing.assert_close(rms_norm_triton(q, None, 1e-6), rms_norm_ref(q, None, 1e-6), **TOL[dtype])


def test_dispatcher_and_force():
    x, w = _inputs(2, 40, torch.float32)
    with backend("triton"):
        torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL[torch.float32])
        assert rms_norm(x[:0], w, 1e-5).shape == (0, 40)


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, w: rms_norm_triton(x[0], w, 1e-6),  # 1-D
        lambda x, w: rms_norm_triton(x.t(), w[:2], 1e-6),  # stride on the last dim
        lambda x, w: rms_norm_triton(x, w[:-1], 1e-6),  # weight width
        lambda x, w: rms_norm_triton(x.int(), w, 1e-6),  # dtype
        lambda x, w: rms_norm_triton(x, w, 1e-6, residual=x[:1]),  # residual shape
        lambda x, w: rms_norm_triton(x, w, 1e-6, residual=x, post_add=x),  # post_add with residual
        lambda x, w: rms_norm_triton(x, w, 1e-6, post_add=x[:1]),  # post_add shape
        lambda x, w: rms_norm_triton(x, w, 1e-6, post_scale=w[:2]),  # post_scale of two elements
    ],
)
def test_launcher_rejects(bad):
    x, w = _inputs(2, 40, torch.float32)
    with pytest.raises(ValueError, match="rms_norm"):
        bad(x, w)


# ---- real shapes, GPU only ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2816, 5376])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_gpu_real_shapes(rows, hidden):
    x, w = _inputs(rows, hidden, torch.bfloat16)
    r = _inputs(rows, hidden, torch.bfloat16, seed=1)[0]
    got = rms_norm_triton(x, w, 1e-6, gemma=True, residual=r)
    ref = rms_norm_ref(x, w, 1e-6, gemma=True, residual=r)
    torch.testing.assert_close(got[0], ref[0], **TOL[torch.bfloat16])
    torch.testing.assert_close(got[-1], ref[-1], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_post_add_and_scale(rows):
    x, w = _inputs(rows, 2816, torch.bfloat16)
    b = _inputs(rows, 2816, torch.bfloat16, seed=1)[0]
    s = torch.tensor([0.8], dtype=torch.bfloat16, device=DEVICE)
    kw = CONVENTIONS["gemma4"]
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6, post_add=b, post_scale=s, **kw),
                               rms_norm_ref(x, w, 1e-6, post_add=b, post_scale=s, **kw), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_pre_norm(rows):
    x, w = _inputs(rows, 2816, torch.bfloat16)
    a, w2 = _inputs(rows, 2816, torch.bfloat16, seed=1)
    b = _inputs(rows, 2816, torch.bfloat16, seed=2)[0]
    s = torch.tensor([0.8], dtype=torch.bfloat16, device=DEVICE)
    kw = dict(CONVENTIONS["gemma4"], post_add=b, post_scale=s, pre_weight=w2, pre_add=a)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6, **kw), rms_norm_ref(x, w, 1e-6, **kw), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_norm_chain(rows):
    """The two Gemma 4 chains at the flagship width: the end of a layer (the top-8 experts' reduce, their
    post_feedforward_layernorm_2 and the dense branch's post_feedforward_layernorm_1 summed,
    post_feedforward_layernorm + residual, layer_scalar, the next input_layernorm) and the post-attention add
    with both pre_feedforward_layernorms."""
    x, w = _inputs(rows, 2816, torch.bfloat16)
    a, w2 = _inputs(rows, 2816, torch.bfloat16, seed=1)
    b, w3 = _inputs(rows, 2816, torch.bfloat16, seed=2)
    _, w4 = _inputs(rows, 2816, torch.bfloat16, seed=3)
    s = torch.tensor([0.8], dtype=torch.bfloat16, device=DEVICE)
    pairs = _inputs(rows * 8, 2816, torch.bfloat16, seed=4)[0]
    weights = torch.rand(rows, 8, device=DEVICE)
    for src, kw in ((pairs, dict(post_add=b, post_scale=s, pre_weight=w2, pre_add=a, pre_add_weight=w3,
                                 next_weights=(w4,), pair_weights=weights)),
                    (x, dict(post_add=b, next_weights=(w3, w4)))):
        kw.update(CONVENTIONS["gemma4"])
        for g, r in zip(rms_norm_triton(src, w, 1e-6, **kw), rms_norm_ref(src, w, 1e-6, **kw)):
            torch.testing.assert_close(g, r, **TOL[torch.bfloat16])


if __name__ == "__main__":
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    import kernels_micro

    kernels_micro.main(["norm"])
