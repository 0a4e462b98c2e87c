"""FusedMoE: the grouped and per-pair paths against each other and a naive loop (fp32, atol 1e-5), and
whole MoE blocks against transformers' sparse MoE blocks with the same weights (fp32, atol 1e-5)."""
from __future__ import annotations

import pytest
import torch

from sparrow.kernels.activation.act import ACTIVATIONS, gelu_and_mul_ref, gelu_tanh_and_mul_ref, get_activation, \
    silu_and_mul_ref
from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref
from sparrow.layers.moe import FusedMoE, MoEBlock, SharedExpert
from sparrow.layers.router import Gemma4Router, HashRouter, Router
from sparrow.quant.fp8_moe import quantize_experts


def _hf(name: str):
    """transformers.models.<name>, or skip: the GPU machine's older transformers may lack a family."""
    return pytest.importorskip(f"transformers.models.{name}")


H, I = 67, 24  # odd hidden size


def _experts(num_experts: int, activation: str = "silu", **kw) -> FusedMoE:
    moe = FusedMoE(num_experts, H, I, activation=activation, **kw)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, H**-0.5)
        moe.down_proj.normal_(0, I**-0.5)
    return moe


def _routing(rows: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(rows, num_experts).argsort(dim=-1)[:, :top_k]  # distinct experts per row
    return torch.rand(rows, top_k), ids


def _naive(x, moe: FusedMoE, weights, ids):
    act = get_activation(moe.activation)
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            out[r] += weights[r, k] * (moe.down_proj[e] @ act(moe.gate_up_proj[e] @ x[r]))
    return out


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 33, 257])
@pytest.mark.parametrize("num_experts", [4, 8, 16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_paths_agree(rows, num_experts, top_k):
    torch.manual_seed(rows * 100 + num_experts * 10 + top_k)
    moe = _experts(num_experts)
    x = torch.randn(rows, H)
    w, ids = _routing(rows, num_experts, top_k)
    args = (x, moe.gate_up_proj, moe.down_proj, w, ids, moe.activation)
    grouped, per_pair = fused_moe_grouped_ref(*args), fused_moe_per_pair_ref(*args)
    assert grouped.shape == (rows, H) and grouped.dtype == x.dtype
    torch.testing.assert_close(grouped, per_pair, atol=1e-5, rtol=0)
    if rows <= 17:
        torch.testing.assert_close(grouped, _naive(x, moe, w, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows,threshold", [(3, 64), (17, 8)])  # per-pair and grouped reference paths
@pytest.mark.parametrize("fp8", [False, True])
def test_unreduced_pairs_reduce_to_the_output(rows, threshold, fp8):
    """``FusedMoE(..., reduce=False)``: the per-pair outputs [R K, H] in pair order, which moe_reduce turns into
    the reduced output."""
    from sparrow.kernels.moe.moe import moe_reduce_ref

    torch.manual_seed(rows)
    moe = _experts(8)
    moe.pair_threshold = threshold
    if fp8:
        moe = FusedMoE(8, 128, 128)
        with torch.no_grad():
            moe.gate_up_proj.normal_(0, 0.1)
            moe.down_proj.normal_(0, 0.1)
        moe.pair_threshold = threshold
        quantize_experts(moe)
    x = torch.randn(rows, moe.hidden_size)
    w, ids = _routing(rows, 8, 3)
    pairs = moe(x, w, ids, reduce=False)
    assert pairs.shape == (rows * 3, moe.hidden_size)
    torch.testing.assert_close(moe_reduce_ref(pairs, w, x.dtype), moe(x, w, ids), atol=1e-6, rtol=1e-6)
    for r, k in ((0, 0), (rows - 1, 2)):  # pair p = row p // K, slot p % K: that expert alone
        alone = moe(x[r:r + 1], torch.ones(1, 1), ids[r:r + 1, k:k + 1])
        torch.testing.assert_close(pairs[r * 3 + k], alone[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
def test_paths_agree_activations_and_clamp(activation, swiglu_limit):
    torch.manual_seed(9)
    moe = _experts(8, activation, swiglu_limit=swiglu_limit)
    x = torch.randn(33, H)
    w, ids = _routing(33, 8, 2)
    args = (x, moe.gate_up_proj, moe.down_proj, w, ids, activation, swiglu_limit)
    torch.testing.assert_close(fused_moe_grouped_ref(*args), fused_moe_per_pair_ref(*args), atol=1e-5, rtol=0)


def test_dispatch_by_pair_threshold(monkeypatch):
    import sparrow.quant.unquantized as moe_mod  # the unquantized method picks the torch path

    calls = []
    for name in ("fused_moe_grouped_ref", "fused_moe_per_pair_ref"):
        fn = getattr(moe_mod, name)
        monkeypatch.setattr(moe_mod, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    moe = _experts(8, pair_threshold=8)
    for rows in (4, 5):  # 8 pairs -> per-pair, 10 pairs -> grouped
        moe(torch.randn(rows, H), *_routing(rows, 8, 2))
    assert calls == ["fused_moe_per_pair_ref", "fused_moe_grouped_ref"]


def test_bf16_close_to_fp32():
    torch.manual_seed(10)
    moe = _experts(8)
    x = torch.randn(33, H)
    w, ids = _routing(33, 8, 2)
    ref = fused_moe_grouped_ref(x, moe.gate_up_proj, moe.down_proj, w, ids)
    wb, db = moe.gate_up_proj.bfloat16(), moe.down_proj.bfloat16()
    for path in (fused_moe_grouped_ref, fused_moe_per_pair_ref):
        out = path(x.bfloat16(), wb, db, w, ids)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


def test_activations():
    """The twins compute transformers' ``act_fn(gate) * up`` in x's dtype, bit for bit (bf16: two roundings)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 2 * 7) * 3).to(dtype)
        gate, up = x[:, :7], x[:, 7:]
        torch.testing.assert_close(silu_and_mul_ref(x), torch.nn.functional.silu(gate) * up, atol=0, rtol=0)
        torch.testing.assert_close(gelu_tanh_and_mul_ref(x), torch.nn.functional.gelu(gate, approximate="tanh") * up,
                                   atol=0, rtol=0)
        torch.testing.assert_close(gelu_and_mul_ref(x), torch.nn.functional.gelu(gate) * up, atol=0, rtol=0)
    assert set(ACTIVATIONS) >= {"silu", "gelu_pytorch_tanh", "gelu"}
    with pytest.raises(ValueError, match="relu2"):
        FusedMoE(4, H, I, activation="relu2")


# --- whole blocks against transformers -----------------------------------------------------------------

E, K = 8, 2


def _randomize(module: torch.nn.Module, std: float = 0.2) -> None:
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * std)


def _compare_block(ref, ours: MoEBlock, rows: int, rename: dict[str, str] | None = None, **kwargs) -> None:
    """Copy ref's (randomized) weights into ours under HF names (``rename``: substring -> replacement,
    what the model's weight table does) and compare forward on both expert paths."""
    state = ref.state_dict()
    for old, new in (rename or {}).items():
        state = {k.replace(old, new): v for k, v in state.items()}
    ours.load_state_dict(state, strict=True)
    x = torch.randn(1, rows, H)
    with torch.no_grad():
        expected = ref(x, **kwargs).reshape(rows, H)
        for threshold in (0, 1 << 30):  # grouped, then per-pair
            ours.experts.pair_threshold = threshold
            got = ours(x.reshape(rows, H), **{k: v.reshape(-1) for k, v in kwargs.items()})
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


BLOCK_ROWS = [1, 3, 33]


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_mixtral_block(rows):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(11)
    ref = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                              num_experts_per_tok=K)).eval()
    _randomize(ref)
    ours = MoEBlock(Router(H, E, K, renormalize=True), FusedMoE(E, H, I))
    _compare_block(ref, ours, rows)


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_qwen2_moe_block_with_shared_expert(rows):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(12)
    config = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=40,
                            num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
    ref = Qwen2MoeSparseMoeBlock(config).eval()
    _randomize(ref)
    ours = MoEBlock(Router(H, E, K), FusedMoE(E, H, I), SharedExpert(H, 40), shared_expert_gate=True)
    _compare_block(ref, ours, rows)


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_qwen3_moe_block(rows):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(13)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=True)
    ref = Qwen3MoeSparseMoeBlock(config).eval()
    _randomize(ref)
    ours = MoEBlock(Router(H, E, K, renormalize=True), FusedMoE(E, H, I))
    _compare_block(ref, ours, rows)


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_deepseek_v3_block(rows):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(14)
    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                              n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)
    ref = DeepseekV3MoE(config).eval()
    _randomize(ref)
    gate = Router(H, E, K, "sigmoid", True, True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    ours = MoEBlock(gate, FusedMoE(E, H, I), SharedExpert(H, I))
    _compare_block(ref, ours, rows, {"shared_experts.": "shared_expert."})


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_minimax_m2_block(rows):
    MiniMaxM2Config = _hf("minimax_m2.configuration_minimax_m2").MiniMaxM2Config
    MiniMaxM2SparseMoeBlock = _hf("minimax_m2.modeling_minimax_m2").MiniMaxM2SparseMoeBlock

    torch.manual_seed(15)
    ref = MiniMaxM2SparseMoeBlock(MiniMaxM2Config(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                  num_experts_per_tok=K)).eval()
    _randomize(ref)
    ours = MoEBlock(Router(H, E, K, "sigmoid", True, True), FusedMoE(E, H, I))
    # the bias sits on the block in MiniMax-M2 (mlp.e_score_correction_bias), on the gate in sparrow
    _compare_block(ref, ours, rows, {"e_score_correction_bias": "gate.e_score_correction_bias"})


@pytest.mark.parametrize("rows", BLOCK_ROWS)
@pytest.mark.parametrize("hash_layer", [False, True])
def test_deepseek_v4_block(rows, hash_layer):
    DeepseekV4Config = _hf("deepseek_v4.configuration_deepseek_v4").DeepseekV4Config
    DeepseekV4SparseMoeBlock = _hf("deepseek_v4.modeling_deepseek_v4").DeepseekV4SparseMoeBlock

    torch.manual_seed(16)
    config = DeepseekV4Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                              vocab_size=100, num_hidden_layers=2, routed_scaling_factor=1.5, swiglu_limit=0.3,
                              mlp_layer_types=["hash_moe" if hash_layer else "moe"] * 2)
    ref = DeepseekV4SparseMoeBlock(config, 0).eval()
    if hash_layer:
        gate = HashRouter(H, E, K, 100, "sqrtsoftplus", 1.5)
    else:
        gate = Router(H, E, K, "sqrtsoftplus", True, True, routed_scaling_factor=1.5)
    ours = MoEBlock(gate, FusedMoE(E, H, I, swiglu_limit=0.3), SharedExpert(H, I, swiglu_limit=0.3))
    _randomize(ref)
    kwargs = {}
    if hash_layer:
        with torch.no_grad():
            ref.gate.tid2eid.copy_(torch.rand(100, E).argsort(dim=-1)[:, :K])
        kwargs["input_ids"] = torch.randint(0, 100, (1, rows))
    _compare_block(ref, ours, rows, {"shared_experts.": "shared_expert."}, **kwargs)


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_gemma4_router_and_experts(rows):
    """Gemma 4: the router reads the raw residual, the experts the pre-FF-norm-2 output."""
    Gemma4TextConfig = _hf("gemma4.configuration_gemma4").Gemma4TextConfig
    Gemma4RMSNorm = _hf("gemma4.modeling_gemma4").Gemma4RMSNorm
    Gemma4TextExperts = _hf("gemma4.modeling_gemma4").Gemma4TextExperts
    Gemma4TextRouter = _hf("gemma4.modeling_gemma4").Gemma4TextRouter

    torch.manual_seed(17)
    config = Gemma4TextConfig(hidden_size=H, num_experts=E, top_k_experts=K, moe_intermediate_size=I,
                              enable_moe_block=True)
    router, experts = Gemma4TextRouter(config), Gemma4TextExperts(config)
    norm = Gemma4RMSNorm(H, eps=config.rms_norm_eps)
    for m in (router, experts, norm):
        _randomize(m)
    with torch.no_grad():
        router.scale.add_(1.0)
        router.per_expert_scale.add_(1.0)
    ours_router = Gemma4Router(H, E, K, eps=config.rms_norm_eps)
    ours_router.load_state_dict(router.state_dict())
    ours_experts = FusedMoE(E, H, I, activation=config.hidden_activation)
    ours_experts.load_state_dict(experts.state_dict())
    x = torch.randn(rows, H)
    with torch.no_grad():
        _, w, ids = router(x)
        expected = experts(norm(x), ids, w)
        for threshold in (0, 1 << 30):
            ours_experts.pair_threshold = threshold
            got = ours_experts(norm(x), *ours_router(x))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
