"""MoE GGUF files (qwen3moe, qwen2moe, Mixtral as llama with experts, gemma4) and two dense ones (llama, qwen3)
written here by tests/loader/_gguf_writer.py from tiny random transformers models, the way convert_hf_to_gguf.py
writes them, with their 2-D / 3-D weights as random Q4_K / Q6_K / Q8_0 / Q5_0 blocks; loaded by sparrow's
LLM (CPU, fp32) against transformers fp32 on gguf-py's dequantization of the same blocks.

Shapes: hidden 256 (so K-quant rows fit), 4 heads of 64, 2 layers (qwen3moe: 3, its middle one dense), 4
experts top-2 of width 64, vocab 320; Gemma 4 one sliding (window 8) and one k_eq_v full layer (head dim 128).
Prompts of 5, 19 and 27 ids, 12 greedy tokens. Tolerance: ids equal up to the first step where transformers'
top-2 logit gap is below 1e-3, logprobs within 1e-3 (tests/models/test_packaged_models.py's rule).
Error cases: a missing expert tensor, an unknown architecture, an expert count the tensors do not hold.
"""
from __future__ import annotations

import pytest
import torch

from sparrow import SamplingParams
from sparrow.errors import ModelLoadError, UnsupportedArchitectureError
from sparrow.loader.model_loader import load_model
from tests.helpers import make_llm
from tests.loader._gguf_writer import write_gguf
from tests.models._hf_tiny import DENSE, FAMILIES, build, compare, hf_greedy, prompts

NEW = 12
GAP = LOGPROB_ATOL = 1e-3
PROMPTS = prompts()
SMALL = dict(vocab_size=320, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, num_hidden_layers=2)
CASES = {  # family -> (table, overrides)
    "qwen3_moe": (FAMILIES, dict(SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=64, mlp_only_layers=[1], use_sliding_window=False,
                                 sliding_window=None)),
    "qwen2_moe": (FAMILIES, dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=128, decoder_sparse_step=1, use_sliding_window=False,
                                 sliding_window=None)),
    "mixtral": (FAMILIES, dict(SMALL, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                               sliding_window=None)),
    "gemma4": (FAMILIES, dict(SMALL, global_head_dim=128, num_global_key_value_heads=1, num_experts=4,
                              top_k_experts=2, moe_intermediate_size=64, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])),
    "llama": (DENSE, dict(SMALL)),
    "qwen3": (DENSE, dict(SMALL)),
}


def tiny(family: str, root, **overrides):
    """The tiny transformers model of ``family`` (built and perturbed by tests/models/_hf_tiny.build)."""
    table, kw = CASES[family]
    return build(table, family, root / f"{family}-hf", **{**kw, **overrides})


def _params():
    return SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)


@pytest.mark.parametrize("family", list(CASES))
def test_greedy_matches_transformers_on_the_dequantized_blocks(family, tmp_path):
    path = tmp_path / f"{family}.gguf"
    oracle = write_gguf(tiny(family, tmp_path), family, path)
    llm = make_llm(path, max_model_len=128)
    assert_packed(llm.engine.runner.model)
    compared = 0
    for p in PROMPTS:
        ids, logits = hf_greedy(oracle, p, NEW)
        out = llm.generate({"prompt_token_ids": p}, _params())[0].outputs[0]
        compared += compare(ids, logits, out, tie_gap=GAP, atol=LOGPROB_ATOL)
    assert compared >= NEW * len(PROMPTS) // 2, f"only {compared} steps free of near-ties"


def assert_packed(model) -> None:
    """Every Linear, expert layer and vocab table of ``model`` runs the GGUF format on uint8 blocks (no float
    copy)."""
    from sparrow.quant.gguf import GGUFEmbeddingMethod, GGUFLinearMethod, GGUFMoEMethod

    layers = [m for m in model.modules() if getattr(m, "quant_kind", None) is not None]
    assert layers
    for m in layers:
        assert isinstance(m.quant_method, (GGUFLinearMethod, GGUFMoEMethod, GGUFEmbeddingMethod)), \
            type(m.quant_method)
        if isinstance(m.quant_method, GGUFMoEMethod):
            assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.uint8
        else:
            assert all(t is not None for t, _, _ in m.gguf_segments)


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "mlp_only_layers", "router_scoring", "attention_k_eq_v")


@pytest.mark.parametrize("family", list(CASES))
def test_config_matches_the_hf_config_json(family, tmp_path):
    """ModelConfig from the GGUF metadata and tensor names == ModelConfig.from_hf of the HF model's own
    config.json (shapes, per-layer types / head dims / KV heads / RoPE, MoE fields)."""
    import json

    from sparrow.config import ModelConfig
    from tests.loader.test_gguf_config import assert_same_config

    write_gguf(tiny(family, tmp_path), family, tmp_path / "m.gguf")
    got = load_model(tmp_path / "m.gguf").config
    want = ModelConfig.from_hf(json.loads((tmp_path / f"{family}-hf" / "config.json").read_text()))
    assert_same_config(got, want)
    for f in MOE_FIELDS:
        assert getattr(got, f) == getattr(want, f), (f, getattr(got, f), getattr(want, f))


def test_mixtral_gguf_builds_mixtral_and_qwen3moe_keeps_its_dense_layer(tmp_path):
    """llama + expert_count is Mixtral; qwen3moe's layer without a router is a dense MLP (mlp_only_layers)."""
    write_gguf(tiny("mixtral", tmp_path), "mixtral", tmp_path / "m.gguf")
    loaded = load_model(tmp_path / "m.gguf")
    assert loaded.config.architecture == "MixtralForCausalLM" and loaded.config.num_experts == 4
    write_gguf(tiny("qwen3_moe", tmp_path), "qwen3_moe", tmp_path / "q.gguf")
    cfg = load_model(tmp_path / "q.gguf").config
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True] and cfg.norm_topk_prob


def _raises(exc, path, *needles):
    with pytest.raises(exc) as info:
        load_model(path)
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


@pytest.mark.parametrize("family, dropped", [("qwen3_moe", "blk.2.ffn_up_exps.weight"),
                                             ("qwen2_moe", "blk.0.ffn_gate_inp_shexp.weight"),
                                             ("gemma4", "blk.1.ffn_down_exps.weight"),
                                             ("gemma4", "rope_freqs.weight")])
def test_missing_expert_tensor_is_named(family, dropped, tmp_path):
    path = tmp_path / "x.gguf"
    write_gguf(tiny(family, tmp_path), family, path, drop=(dropped,))
    _raises(ModelLoadError, path, repr(dropped), "lacks")


def test_unknown_architecture_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    write_gguf(tiny("qwen3_moe", tmp_path), "qwen3_moe", path, arch="grok")
    _raises(UnsupportedArchitectureError, path, "'grok'", "qwen3moe", "gemma4")


def test_expert_count_the_tensors_do_not_hold_is_named(tmp_path):
    """The metadata says 8 experts; the router and the merged expert tensors hold 4."""
    path = tmp_path / "x.gguf"
    model = tiny("qwen3_moe", tmp_path)
    write_gguf(model, "qwen3_moe", path, metadata={"qwen3moe.expert_count": 8})
    _raises(ModelLoadError, path, "holds 4 experts", "qwen3moe.expert_count is 8", "blk.0.ffn_")


def test_top_k_above_the_expert_count_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    write_gguf(tiny("mixtral", tmp_path), "mixtral", path, metadata={"llama.expert_used_count": 5})
    _raises(ModelLoadError, path, "llama.expert_used_count=5", "llama.expert_count=4")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "gemma4"])
def test_greedy_on_cuda_matches_transformers(family, tmp_path):
    """The same files on the GPU (fp32, Triton kernels): ids and logprobs against transformers on the CPU."""
    path = tmp_path / f"{family}.gguf"
    oracle = write_gguf(tiny(family, tmp_path), family, path)
    llm = make_llm(path, max_model_len=128, device="cuda")
    compared = 0
    for p in PROMPTS:
        ids, logits = hf_greedy(oracle, p, NEW)
        compared += compare(ids, logits, llm.generate({"prompt_token_ids": p}, _params())[0].outputs[0],
                            tie_gap=GAP, atol=LOGPROB_ATOL)
    assert compared >= NEW * len(PROMPTS) // 2, f"only {compared} steps free of near-ties"
