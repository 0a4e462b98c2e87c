"""Routers against their transformers modules (fp32, CPU): same expert sets per row, weights to atol 1e-6.

Random fp32 weights and inputs make ties in the scores practically impossible."""
from __future__ import annotations

import pytest
import torch

from sparrow.kernels.moe.router import select_experts
from sparrow.layers.router import Gemma4Router, HashRouter, Router


def _hf(name: str):
    """transformers.models.<name>, or skip: the GPU machine's older transformers may lack a family."""
    return pytest.importorskip(f"transformers.models.{name}")


H, E, K = 67, 16, 4  # odd hidden size


def _randomize(module: torch.nn.Module, std: float = 0.2) -> None:
    """Fill every float parameter / buffer of an HF module (created with torch.empty) with N(0, std)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * std)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row's (id, weight) pairs by id so routers that order their top-k differently compare."""
    ids, order = ids.long().sort(dim=-1)
    return weights.float().gather(1, order), ids


def _assert_same_routing(ours, theirs) -> None:
    w, i = _by_id(*ours)
    w_ref, i_ref = _by_id(*theirs)
    torch.testing.assert_close(i, i_ref, atol=0, rtol=0)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def _x(rows: int) -> torch.Tensor:
    return torch.randn(rows, H)


ROWS = [1, 17, 257]


@pytest.mark.parametrize("rows", ROWS)
def test_mixtral(rows):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    torch.manual_seed(0)
    ref = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K))
    _randomize(ref)
    ours = Router(H, E, K, scoring="softmax", renormalize=True)
    ours.load_state_dict(ref.state_dict())
    x = _x(rows)
    _, w_ref, i_ref = ref(x)
    _assert_same_routing(ours(x), (w_ref, i_ref))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen_moe(rows, family, norm_topk_prob):
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Config
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as Ref
    else:
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Ref

    torch.manual_seed(1)
    ref = Ref(Config(hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob))
    _randomize(ref)
    ours = Router(H, E, K, scoring="softmax", renormalize=norm_topk_prob)
    ours.load_state_dict(ref.state_dict())
    x = _x(rows)
    _, w_ref, i_ref = ref(x)
    _assert_same_routing(ours(x), (w_ref, i_ref))


@pytest.mark.parametrize("rows", ROWS)
def test_gemma4(rows):
    Gemma4TextConfig = _hf("gemma4.configuration_gemma4").Gemma4TextConfig
    Gemma4TextRouter = _hf("gemma4.modeling_gemma4").Gemma4TextRouter

    torch.manual_seed(2)
    config = Gemma4TextConfig(hidden_size=H, num_experts=E, top_k_experts=K, moe_intermediate_size=24,
                              enable_moe_block=True)
    ref = Gemma4TextRouter(config)
    with torch.no_grad():
        ref.proj.weight.normal_(0, 1.0)
        ref.scale.copy_(1 + 0.3 * torch.randn(H))
        ref.per_expert_scale.copy_(1 + 0.3 * torch.randn(E))
    ours = Gemma4Router(H, E, K, eps=config.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    x = 3 * _x(rows)
    _, w_ref, i_ref = ref(x)
    _assert_same_routing(ours(x), (w_ref, i_ref))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n_group,topk_group,norm_topk_prob", [(4, 2, True), (8, 3, False), (1, 1, True)])
def test_deepseek_v3(rows, n_group, topk_group, norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(3)
    config = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(config)
    _randomize(ref)
    ours = Router(H, E, K, scoring="sigmoid", renormalize=norm_topk_prob, use_correction_bias=True,
                  n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    ours.load_state_dict(ref.state_dict())
    x = _x(rows)
    _, w_ref, i_ref = ref(x)
    _assert_same_routing(ours(x), (w_ref, i_ref))


@pytest.mark.parametrize("rows", ROWS)
def test_minimax_m2(rows):
    MiniMaxM2Config = _hf("minimax_m2.configuration_minimax_m2").MiniMaxM2Config
    MiniMaxM2SparseMoeBlock = _hf("minimax_m2.modeling_minimax_m2").MiniMaxM2SparseMoeBlock

    torch.manual_seed(4)
    block = MiniMaxM2SparseMoeBlock(MiniMaxM2Config(hidden_size=H, num_local_experts=E, num_experts_per_tok=K,
                                                    intermediate_size=24))
    _randomize(block)
    ours = Router(H, E, K, scoring="sigmoid", renormalize=True, use_correction_bias=True)
    # MiniMax-M2 keeps the bias on the block (mlp.e_score_correction_bias): the weight table renames it.
    ours.load_state_dict({"weight": block.gate.weight, "e_score_correction_bias": block.e_score_correction_bias})
    x = _x(rows)
    _, w_ref, i_ref = block.gate(x, block.e_score_correction_bias)
    _assert_same_routing(ours(x), (w_ref, i_ref))


def _deepseek_v4_config():
    DeepseekV4Config = _hf("deepseek_v4.configuration_deepseek_v4").DeepseekV4Config

    return DeepseekV4Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=24,
                            vocab_size=100, num_hidden_layers=2, routed_scaling_factor=1.5)


@pytest.mark.parametrize("rows", ROWS)
def test_deepseek_v4(rows):
    DeepseekV4TopKRouter = _hf("deepseek_v4.modeling_deepseek_v4").DeepseekV4TopKRouter

    torch.manual_seed(5)
    config = _deepseek_v4_config()
    assert config.scoring_func == "sqrtsoftplus"
    ref = DeepseekV4TopKRouter(config)
    _randomize(ref)
    ours = Router(H, E, K, scoring="sqrtsoftplus", renormalize=True, use_correction_bias=True,
                  routed_scaling_factor=1.5)
    ours.load_state_dict(ref.state_dict())
    x = _x(rows)
    _, w_ref, i_ref = ref(x)
    _assert_same_routing(ours(x), (w_ref, i_ref))


@pytest.mark.parametrize("rows", ROWS)
def test_deepseek_v4_hash(rows):
    DeepseekV4HashRouter = _hf("deepseek_v4.modeling_deepseek_v4").DeepseekV4HashRouter

    torch.manual_seed(6)
    config = _deepseek_v4_config()
    ref = DeepseekV4HashRouter(config)
    _randomize(ref)
    with torch.no_grad():
        ref.tid2eid.copy_(torch.rand(config.vocab_size, E).argsort(dim=-1)[:, :K])
    ours = HashRouter(H, E, K, vocab_size=config.vocab_size, scoring="sqrtsoftplus", routed_scaling_factor=1.5)
    ours.load_state_dict(ref.state_dict())
    x, input_ids = _x(rows), torch.randint(0, config.vocab_size, (rows,))
    _, w_ref, i_ref = ref(x, input_ids)
    _assert_same_routing(ours(x, input_ids), (w_ref, i_ref))


def test_bias_only_selects():
    """A large bias on expert 0 forces it in, but its weight is still its unbiased score."""
    torch.manual_seed(7)
    logits = torch.randn(5, E)
    bias = torch.zeros(E)
    bias[0] = 100.0
    w, ids = select_experts(logits, K, scoring="sigmoid", e_score_correction_bias=bias)
    assert bool((ids[:, 0] == 0).all())
    torch.testing.assert_close(w[:, 0], logits[:, 0].sigmoid(), atol=1e-7, rtol=0)


def test_grouped_topk_keeps_only_chosen_groups():
    torch.manual_seed(8)
    logits = torch.randn(33, E)
    _, ids = select_experts(logits, K, scoring="sigmoid", n_group=8, topk_group=2)
    groups = ids // (E // 8)  # 2 experts per group
    assert max(len(set(row.tolist())) for row in groups) <= 2
    _, ids_flat = select_experts(logits, K, scoring="sigmoid")
    assert not torch.equal(ids_flat.sort(-1).values, ids.sort(-1).values)  # the grouping matters here


def test_errors_name_the_problem():
    logits = torch.randn(2, E)
    with pytest.raises(ValueError, match="softmux"):
        select_experts(logits, K, scoring="softmux")
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, E + 1)
    with pytest.raises(ValueError, match="n_group"):
        select_experts(logits, K, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="topk_group"):
        select_experts(logits, K, n_group=4)


def test_gemma4_router_folded_weight_follows_parameter_changes():
    """The fp32 weight with scale x H^-0.5 folded in is rebuilt when proj.weight or scale change in place."""
    torch.manual_seed(0)
    r = Gemma4Router(16, 4, 2)
    with torch.no_grad():
        r.proj.weight.normal_()
        r.scale.normal_()
    x = torch.randn(3, 16)

    def unfolded():
        h = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + r.eps, -0.5)
        return (h * r.scale * 16**-0.5) @ r.proj.weight.t()

    torch.testing.assert_close(r.logits(x), unfolded(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        r.scale.mul_(3.0)
        r.proj.weight.add_(1.0)
    torch.testing.assert_close(r.logits(x), unfolded(), rtol=1e-5, atol=1e-5)
