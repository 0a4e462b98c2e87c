"""RMSNorm module: ``norm_add`` (the post-norm residual add, Gemma 4's layer_scalar) equals the unfused ops
on the torch path bit for bit, and the fused Triton kernel (interpreter on CPU) matches it."""
import pytest
import torch

from sparrow.kernels import backend
from sparrow.layers.norm import RMSNorm


@pytest.mark.parametrize("kind", ["llama", "gemma", "gemma4"])
@pytest.mark.parametrize("with_scale", [False, True])
def test_norm_add(kind, with_scale):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-6, kind=kind)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x, add = torch.randn(5, 48, generator=g) * 3, torch.randn(5, 48, generator=g)
    scale = torch.tensor([0.6]) if with_scale else None
    want = add + norm(x)
    if scale is not None:
        want = want * scale
    with backend("torch"):
        torch.testing.assert_close(norm.norm_add(x, add, scale), want, atol=0, rtol=0)
    with backend("triton"):
        torch.testing.assert_close(norm.norm_add(x, add, scale), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind2,eps2", [("gemma4", 1e-6), ("gemma4", 1e-5), ("llama", 1e-6)])
def test_norm_add_with_pre_norm(kind2, eps2):
    """``pre=(norm2, add2)``: norm2.norm_add first; one fused kernel when kind and eps agree, two otherwise."""
    g = torch.Generator().manual_seed(1)
    norm, norm2 = RMSNorm(48, 1e-6, kind="gemma4"), RMSNorm(48, eps2, kind=kind2)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
        norm2.weight.copy_(torch.randn(48, generator=g))
    x, add, add2 = (torch.randn(5, 48, generator=g) * 3 for _ in range(3))
    scale = torch.tensor([0.6])
    want = (add + norm(add2 + norm2(x))) * scale
    with backend("torch"):
        torch.testing.assert_close(norm.norm_add(x, add, scale, pre=(norm2, add2)), want, atol=0, rtol=0)
    with backend("triton"):
        torch.testing.assert_close(norm.norm_add(x, add, scale, pre=(norm2, add2)), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind_other,eps_other", [("gemma4", 1e-6), ("gemma4", 1e-5), ("llama", 1e-6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_add_chain(kind_other, eps_other, dtype):
    """``pre_add_norm`` and ``next_norms``: the ops one by one on the torch path; on the Triton path one kernel
    when every norm agrees in kind and eps (here the next norm may differ, which falls back to separate ops)."""
    g = torch.Generator().manual_seed(2)
    norm, norm2, norm3 = (RMSNorm(48, 1e-6, kind="gemma4", dtype=dtype) for _ in range(3))
    nxt, nxt2 = RMSNorm(48, 1e-6, kind="gemma4", dtype=dtype), RMSNorm(48, eps_other, kind=kind_other, dtype=dtype)
    with torch.no_grad():
        for n in (norm, norm2, norm3, nxt, nxt2):
            n.weight.copy_(torch.randn(48, generator=g))
    x, add, add2 = ((torch.randn(5, 48, generator=g) * 3).to(dtype) for _ in range(3))
    scale = torch.tensor([0.6], dtype=dtype)
    y = (add + norm(norm3(add2) + norm2(x))) * scale
    want = (y, nxt(y), nxt2(y))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, t in (("torch", dict(atol=0, rtol=0)), ("triton", tol)):
        with backend(name):
            got = norm.norm_add(x, add, scale, pre=(norm2, add2), pre_add_norm=norm3, next_norms=(nxt, nxt2))
            assert len(got) == 3
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **t)
        with backend(name):  # without pre: the post-attention chain (h, pre_feedforward_layernorm(h), ...)
            got = norm.norm_add(x, add, next_norms=(nxt,))
            torch.testing.assert_close(got[1], nxt(add + norm(x)), **t)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_norm_add_pair_weights(backend_name):
    """``pair_weights``: the experts' per-pair outputs are reduced (moe_reduce) before the chain; the same result
    as reducing first, fused or not (a differing next norm falls back to separate ops)."""
    from sparrow.kernels.moe.moe import moe_reduce_ref

    g = torch.Generator().manual_seed(3)
    norm, norm2, norm3 = (RMSNorm(48, 1e-6, kind="gemma4") for _ in range(3))
    other = RMSNorm(48, 1e-5, kind="gemma4")
    for n in (norm, norm2, norm3, other):
        with torch.no_grad():
            n.weight.copy_(torch.randn(48, generator=g))
    pairs, add, add2 = torch.randn(10, 48, generator=g), torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    weights = torch.rand(5, 2, generator=g)
    tol = dict(atol=0, rtol=0) if backend_name == "torch" else dict(atol=1e-5, rtol=1e-5)
    with backend(backend_name):
        for nxt in (norm3, other):
            got = norm.norm_add(pairs, add, pre=(norm2, add2), next_norms=(nxt,), pair_weights=weights)
            want = norm.norm_add(moe_reduce_ref(pairs, weights), add, pre=(norm2, add2), next_norms=(nxt,))
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,module", [("llama", "llama.modeling_llama.LlamaRMSNorm"),
                                         ("gemma", "gemma3.modeling_gemma3.Gemma3RMSNorm"),
                                         ("gemma4", "gemma4.modeling_gemma4.Gemma4RMSNorm")])
def test_torch_path_is_transformers_bit_for_bit(kind, module, dtype):
    """The CPU path (the kernels package's twin, ``rms_norm_ref``) against the transformers module of each
    kind, weights in the model dtype as sparrow loads them: exact, on [R, H], per-head [R, nH, D] and a
    residual add (HF adds in the model dtype)."""
    import importlib

    path, cls = module.rsplit(".", 1)
    hf_cls = getattr(importlib.import_module(f"transformers.models.{path}"), cls)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, generator=g).to(dtype)
    norm = RMSNorm(40, 1e-6, kind=kind, dtype=dtype)
    hf = hf_cls(40, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        hf.weight.copy_(weight)
    x = (torch.randn(6, 40, generator=g) * 3).to(dtype)
    r = torch.randn(6, 40, generator=g).to(dtype)
    with backend("torch"), torch.no_grad():
        torch.testing.assert_close(norm(x), hf(x), atol=0, rtol=0)
        torch.testing.assert_close(norm(x.view(3, 2, 40)), hf(x.view(3, 2, 40)), atol=0, rtol=0)
        y, res = norm(x, r)
        torch.testing.assert_close(res, x + r, atol=0, rtol=0)
        torch.testing.assert_close(y, hf(x + r), atol=0, rtol=0)
