"""Bad checkpoints fail with a one-line ModelLoadError / UnsupportedArchitectureError that names the thing:
an unknown architecture (and the supported ones), a missing or misshaped tensor (and its expected shape),
an unused tensor; tensors of a skipped multimodal tower are not an error; Gemma 4 features sparrow does
not run (per-layer embeddings, KV sharing) are refused, not ignored."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from sparrow.errors import ModelLoadError, UnsupportedArchitectureError
from sparrow.loader.model_loader import load_model
from sparrow.models.registry import supported_architectures
from tests.models._hf_tiny import FAMILIES, build


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("err")
    for family in ("qwen3_moe", "qwen2_moe", "gemma4"):
        build(FAMILIES, family, root / family)
    return root


def _edited(src, dst, edit=None, config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _raises(exc, fn, *needles):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def test_unknown_architecture_names_itself_and_lists_supported(ckpts, tmp_path):
    path = _edited(ckpts / "qwen3_moe", tmp_path / "c", config=lambda c: c.update(architectures=["FooBarForCausalLM"]))
    msg = _raises(UnsupportedArchitectureError, lambda: load_model(path), "FooBarForCausalLM")
    for arch in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Qwen3MoeForCausalLM",
                 "Qwen2MoeForCausalLM", "MixtralForCausalLM", "MiniMaxM2ForCausalLM"):
        assert arch in msg and arch in supported_architectures()


@pytest.mark.parametrize("family, name, expected", [
    ("qwen3_moe", "model.layers.0.mlp.experts.5.up_proj.weight", "(24, 64)"),  # one expert of a stacked tensor
    ("qwen3_moe", "model.layers.2.mlp.gate.weight", "(8, 64)"),
    ("gemma4", "model.layers.1.experts.gate_up_proj", "(16, 48, 64)"),  # fused 3-D
    ("gemma4", "model.layers.1.self_attn.k_proj.weight", "(32, 64)"),  # k_eq_v layer: K (and V) projection
    ("gemma4", "model.layers.0.router.per_expert_scale", "(16,)"),
    ("gemma4", "model.layers.3.layer_scalar", "(1,)"),
])
def test_missing_tensor_names_it_and_its_shape(ckpts, tmp_path, family, name, expected):
    path = _edited(ckpts / family, tmp_path / "c", edit=lambda t: t.pop(name))
    _raises(ModelLoadError, lambda: load_model(path), repr(name), expected)


@pytest.mark.parametrize("family, name, shape, expected", [
    ("qwen3_moe", "model.layers.0.mlp.experts.3.down_proj.weight", (64, 23), "(64, 24)"),
    ("gemma4", "model.layers.0.experts.down_proj", (16, 64, 25), "(16, 64, 24)"),
    ("gemma4", "model.layers.1.self_attn.q_proj.weight", (64, 64), "(128, 64)"),  # full layer: head dim 32
])
def test_misshaped_tensor_names_it_and_the_expected_shape(ckpts, tmp_path, family, name, shape, expected):
    path = _edited(ckpts / family, tmp_path / "c", edit=lambda t: t.__setitem__(name, torch.zeros(shape)))
    _raises(ModelLoadError, lambda: load_model(path), repr(name), str(shape), expected)


@pytest.mark.parametrize("family, name", [
    ("qwen3_moe", "model.layers.1.mlp.experts.0.gate_proj.weight"),  # layer 1 is dense (mlp_only_layers)
    ("qwen3_moe", "model.layers.0.mlp.experts.8.gate_proj.weight"),  # there are 8 experts
    ("gemma4", "model.layers.1.self_attn.v_proj.weight"),  # k_eq_v layers have no v_proj
    ("qwen2_moe", "model.layers.0.mlp.experts.8.gate_proj.weight"),  # Qwen3-MoE's module, its own name
    ("gemma4", "model.vision_tower_extra.weight"),
])
def test_unused_tensor_is_an_error(ckpts, tmp_path, family, name):
    """The message names the tensor and the checkpoint's architecture."""
    path = _edited(ckpts / family, tmp_path / "c", edit=lambda t: t.__setitem__(name, torch.zeros(24, 64)))
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    _raises(ModelLoadError, lambda: load_model(path), repr(name), architecture)


def test_skipped_tower_tensors_are_not_an_error(ckpts, tmp_path, caplog):
    def nest(t):
        for k in list(t):
            t["model.language_model." + k[len("model."):]] = t.pop(k)
        t["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.zeros(4, 4)
        t["model.audio_tower.layers.0.weight"] = torch.zeros(4)

    def as_multimodal(c):
        text = dict(c)
        c.clear()
        c.update(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", text_config=text)

    path = _edited(ckpts / "gemma4", tmp_path / "c", edit=nest, config=as_multimodal)
    with caplog.at_level("INFO"):
        mm = load_model(path).model.state_dict()
    ref = load_model(ckpts / "gemma4").model.state_dict()
    for k in ref:
        torch.testing.assert_close(mm[k], ref[k], rtol=0, atol=0)
    assert "skipped 2 checkpoint tensors" in caplog.text


@pytest.mark.parametrize("name, expected", [
    ("model.language_model.layers.3.layer_scalar", "(1,)"),
    ("model.language_model.layers.1.experts.gate_up_proj", "(16, 48, 64)"),  # fused 3-D experts
    ("model.language_model.layers.0.mlp.up_proj.weight", "(96, 64)"),  # one shard of a packed projection (I 96)
])
def test_missing_tensor_of_a_nested_checkpoint_is_named_as_the_checkpoint_names_it(ckpts, tmp_path, name, expected):
    """A multimodal Gemma 4 checkpoint nests the text model under model.language_model.: a missing tensor is
    named with that prefix, not with sparrow's own module path."""
    def nest(t):
        for k in list(t):
            t["model.language_model." + k[len("model."):]] = t.pop(k)
        t.pop(name)

    def as_multimodal(c):
        text = dict(c)
        c.clear()
        c.update(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", text_config=text)

    path = _edited(ckpts / "gemma4", tmp_path / "c", edit=nest, config=as_multimodal)
    _raises(ModelLoadError, lambda: load_model(path), repr(name), expected)


@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size_per_layer_input", 16, "per-layer input embeddings"),
    ("num_kv_shared_layers", 2, "KV sharing"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
])
def test_gemma4_features_outside_the_moe_model_are_refused(ckpts, tmp_path, key, value, needle):
    path = _edited(ckpts / "gemma4", tmp_path / "c", config=lambda c: c.update({key: value}))
    _raises(ModelLoadError, lambda: load_model(path), key, needle)


def test_truncated_safetensors_file(ckpts, tmp_path):
    path = _edited(ckpts / "qwen3_moe", tmp_path / "c")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _raises(ModelLoadError, lambda: load_model(path), "truncated")
