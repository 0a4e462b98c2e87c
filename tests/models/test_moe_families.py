"""The five MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral, MiniMax-M2, Gemma 4) on tiny random checkpoints
made here with transformers, against transformers' ``generate`` on the same weights, CPU fp32.

Each family's config exercises its own features: Qwen3-MoE a dense layer between MoE layers
(mlp_only_layers) and a sliding window on every layer; Qwen2-MoE decoder_sparse_step=2, the sigmoid-gated
shared expert, top-4 of 16 without renormalization, a sliding layer; Mixtral top-1 with a window; MiniMax-M2
the sigmoid router with a (perturbed) correction bias, whole-projection q/k norms, partial RoPE; Gemma 4
both layer types (k_eq_v full layers with their own head dim / KV heads and proportional RoPE, windowed
sliding layers), dense MLP + 16-expert top-4 MoE, router scales, layer scalars, soft-cap. Prompts of
5, 19 and 27 tokens are longer than the 8-token windows, and their prefill takes the grouped expert path
(> 64 (row, expert) pairs for top-4) while decode takes the per-pair path.

Tolerance: ids equal up to the first step where transformers' top-2 logit gap is < 1e-4; logprobs within
1e-4. The batched test runs all prompts in one engine with a 16-token step budget, so prefill chunks share
steps with decode rows.
"""
from __future__ import annotations

import json

import pytest
import torch

from sparrow import SamplingParams
from sparrow.loader.model_loader import load_model
from tests.helpers import make_llm
from tests.models._hf_tiny import FAMILIES, build, compare, hf_greedy, prompts

NEW = 16
PROMPTS = prompts()


class Case:
    def __init__(self, family: str, root):
        self.family = family
        self.path = root / family
        hf = build(FAMILIES, family, self.path)
        self.hf = [hf_greedy(hf, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp("moe"))


def _params():
    return SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)


def test_greedy_one_at_a_time(case):
    llm = make_llm(case.path, max_model_len=128)
    compared = 0
    for p, (ids, logits) in zip(PROMPTS, case.hf):
        out = llm.generate({"prompt_token_ids": p}, _params())[0].outputs[0]
        compared += compare(ids, logits, out)
    assert compared >= 0.5 * NEW * len(PROMPTS), f"only {compared} steps free of near-ties"


def test_greedy_mixed_length_batch(case):
    llm = make_llm(case.path, max_model_len=128, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params())
    for (ids, logits), o in zip(case.hf, outs):
        compare(ids, logits, o.outputs[0])


def _fused_to_per_expert(tensors: dict) -> dict:
    """transformers 5's experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I] -> experts.N.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def _per_expert_to_fused(tensors: dict) -> dict:
    """experts.N.{gate,up,down}_proj.weight -> fused experts.gate_up_proj / experts.down_proj."""
    import re

    out, groups = {}, {}
    for name, t in tensors.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for base, g in groups.items():
        n = 1 + max(e for e, _ in g)
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([g[e, "gate_proj"], g[e, "up_proj"]]) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([g[e, "down_proj"] for e in range(n)])
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "gemma4"])
def test_per_expert_and_fused_layouts_load_identically(family, tmp_path):
    """Qwen2-MoE is saved per expert by transformers, Gemma 4 fused: each is rewritten in the other layout."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    build(FAMILIES, family, src)
    tensors = load_file(str(src / "model.safetensors"))
    per_expert = any(".experts.0." in n for n in tensors)
    other = _per_expert_to_fused(tensors) if per_expert else _fused_to_per_expert(tensors)
    assert other.keys() != tensors.keys()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(other, str(dst / "model.safetensors"))
    a = load_model(src).model.state_dict()
    b = load_model(dst).model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_gemma4_conditional_generation_checkpoint(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint (text under model.language_model., a vision tower):
    sparrow runs its text decoder, skipping the tower, and matches transformers' text-only generate."""
    import transformers

    from tests.models._hf_tiny import _gemma4_text, perturb_scales

    text = transformers.Gemma4TextConfig(**_gemma4_text())
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    cfg = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    perturb_scales(hf.model.language_model, 0)
    hf.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Gemma4ForConditionalGeneration"]
    llm = make_llm(tmp_path, max_model_len=128)
    for p in PROMPTS[:2]:
        ids, logits = hf_greedy(hf, p, NEW)
        compare(ids, logits, llm.generate({"prompt_token_ids": p}, _params())[0].outputs[0])


def test_gemma4_same_head_dim_on_every_layer(tmp_path):
    """A Gemma 4 whose full-attention layers keep the sliding layers' head dim: transformers (>= 5.2x) saves
    an empty ``per_layer_config`` and no ``global_head_dim``, which means "no layer differs", not the old
    default of 512. Greedy ids and logprobs against transformers on the same weights."""
    hf = build(FAMILIES, "gemma4", tmp_path / "g4", head_dim=16, global_head_dim=16, num_global_key_value_heads=None,
               attention_k_eq_v=False)
    saved = json.loads((tmp_path / "g4" / "config.json").read_text())
    assert not saved.get("per_layer_config") and saved.get("global_head_dim", 16) == 16
    llm = make_llm(tmp_path / "g4", max_model_len=128)
    compared = 0
    for p in PROMPTS[:2]:
        ids, logits = hf_greedy(hf, p, 8)
        compared += compare(ids, logits, llm.generate({"prompt_token_ids": p}, _params())[0].outputs[0])
    assert compared >= 8
