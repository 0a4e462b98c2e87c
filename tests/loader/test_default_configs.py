"""Every family's default transformers config, saved by ``save_pretrained`` and read back by sparrow. Oracle:
transformers' own config object (its ``layer_types`` and ``sliding_window``: which layers attend in a window).
A config transformers accepts must not be refused for a field value transformers writes itself (Qwen2-MoE saves
``sliding_window: 0`` with ``use_sliding_window: false``)."""
from __future__ import annotations

import pytest
import transformers

from sparrow.errors import ModelLoadError
from sparrow.loader.model_loader import read_model_config

FAMILIES = [
    ("LlamaForCausalLM", "LlamaConfig"), ("MistralForCausalLM", "MistralConfig"),
    ("Qwen2ForCausalLM", "Qwen2Config"), ("Qwen3ForCausalLM", "Qwen3Config"),
    ("Gemma3ForCausalLM", "Gemma3TextConfig"), ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"), ("MixtralForCausalLM", "MixtralConfig"),
    ("MiniMaxM2ForCausalLM", "MiniMaxM2Config"),
]


def _saved(tmp_path, arch: str, config_class: str):
    cfg = getattr(transformers, config_class)()
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path)
    return cfg


def _hf_windows(cfg) -> list:
    """Each layer's attention window as transformers runs it (None: full attention)."""
    n = cfg.num_hidden_layers
    window = cfg.to_dict().get("sliding_window")  # Llama has none (the attribute raises)
    types = cfg.to_dict().get("layer_types")
    if types is None:  # Mistral / Mixtral / MiniMax-M2 / Qwen3-MoE: one window for every layer, if any
        use = cfg.to_dict().get("use_sliding_window", True)
        types = ["sliding_attention" if window and use else "full_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("arch, config_class", FAMILIES)
def test_default_transformers_config_loads(tmp_path, arch, config_class):
    hf = _saved(tmp_path, arch, config_class)
    config = read_model_config(tmp_path)[0]
    assert config.architecture == arch
    assert len(config.layers) == hf.num_hidden_layers
    assert [layer.sliding_window for layer in config.layers] == _hf_windows(hf)


def test_qwen2_moe_default_writes_window_zero(tmp_path):
    """The case users hit: the file really holds sliding_window 0, and every layer attends in full."""
    import json

    _saved(tmp_path, "Qwen2MoeForCausalLM", "Qwen2MoeConfig")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["sliding_window"] == 0 and raw["use_sliding_window"] is False
    assert {layer.sliding_window for layer in read_model_config(tmp_path)[0].layers} == {None}


def test_default_gemma4_config_is_refused_for_what_sparrow_lacks(tmp_path):
    """transformers' default Gemma 4 text config is a per-layer-embedding model, which sparrow refuses by name
    (the 26B-A4B MoE shape loads: tests/test_bench.py)."""
    _saved(tmp_path, "Gemma4ForCausalLM", "Gemma4TextConfig")
    with pytest.raises(ModelLoadError, match="hidden_size_per_layer_input"):
        read_model_config(tmp_path)
