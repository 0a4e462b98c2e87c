"""GGUF metadata -> ModelConfig (``sparrow.config.gguf.hf_config_from_gguf``) against HF's config.json values.

The oracle: each model's published HF config values, written out below, normalized by ``ModelConfig.from_hf``.
The metadata side is what llama.cpp's convert_hf_to_gguf.py writes for that config (gguf.md key names):
the shape keys, rope base, epsilon, context length, the window (Gemma 3) and a linear rope scaling. Every field
the metadata lacks is then one of the rules in ``hf_config_from_gguf``'s docstring; a test below covers each.
"""
from __future__ import annotations

import pytest

from sparrow.config import ModelConfig
from sparrow.errors import ModelLoadError, UnsupportedArchitectureError
from sparrow.config.gguf import hf_config_from_gguf

# HF config.json (text_config) values. The Gemma 3 4B / 12B files leave head_dim and query_pre_attn_scalar
# at Gemma3TextConfig's default, 256; the 27B sets head_dim 128 and query_pre_attn_scalar 168 (5376 / 32).
GEMMA3 = {
    "270m": dict(hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 query_pre_attn_scalar=256, num_hidden_layers=18, intermediate_size=2048, sliding_window=512,
                 max_position_embeddings=32768, rope_scaling=None),
    "1b": dict(hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
               query_pre_attn_scalar=256, num_hidden_layers=26, intermediate_size=6912, sliding_window=512,
               max_position_embeddings=32768, rope_scaling=None),
    "4b": dict(hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               query_pre_attn_scalar=256, num_hidden_layers=34, intermediate_size=10240, sliding_window=1024,
               max_position_embeddings=131072, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "12b": dict(hidden_size=3840, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                query_pre_attn_scalar=256, num_hidden_layers=48, intermediate_size=15360, sliding_window=1024,
                max_position_embeddings=131072, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "27b": dict(hidden_size=5376, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                query_pre_attn_scalar=168, num_hidden_layers=62, intermediate_size=21504, sliding_window=1024,
                max_position_embeddings=131072, rope_scaling={"rope_type": "linear", "factor": 8.0}),
}
GEMMA3_COMMON = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
                     rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                     sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)

# Other architectures sparrow loads from GGUF: Qwen2.5-0.5B, Qwen3-0.6B (head_dim 128 != 1024 / 16),
# Mistral-7B-v0.1 (sliding window 4096), SmolLM2-135M (llama).
OTHERS = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, num_attention_heads=14,
                  num_key_value_heads=2, num_hidden_layers=24, intermediate_size=4864, vocab_size=151936,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                  hidden_act="silu", use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, num_hidden_layers=28, intermediate_size=3072,
                  vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                  tie_word_embeddings=True, hidden_act="silu", attention_bias=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, intermediate_size=14336,
                    vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
                    sliding_window=4096, tie_word_embeddings=False, hidden_act="silu"),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, num_attention_heads=9,
                  num_key_value_heads=3, num_hidden_layers=30, intermediate_size=1536, vocab_size=49152,
                  rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                  hidden_act="silu"),
}


def gguf_metadata(arch: str, hf: dict) -> dict:
    """The metadata llama.cpp's converter writes for an HF config (what the file carries, nothing more)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": hf["hidden_size"],
        f"{arch}.block_count": hf["num_hidden_layers"],
        f"{arch}.feed_forward_length": hf["intermediate_size"],
        f"{arch}.attention.head_count": hf["num_attention_heads"],
        f"{arch}.attention.head_count_kv": hf["num_key_value_heads"],
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        f"{arch}.context_length": hf["max_position_embeddings"],
        f"{arch}.rope.freq_base": hf["rope_theta"],
        f"{arch}.vocab_size": hf["vocab_size"],
    }
    if hf.get("sliding_window") and arch in ("gemma3", "mistral"):
        meta[f"{arch}.attention.sliding_window"] = hf["sliding_window"]
    if hf.get("rope_scaling"):
        meta[f"{arch}.rope.scaling.type"] = hf["rope_scaling"]["rope_type"]
        meta[f"{arch}.rope.scaling.factor"] = hf["rope_scaling"]["factor"]
    return meta


def tensors(tied: bool) -> set[str]:
    return {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})


FIELDS = ("architecture", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
          "hidden_act", "tie_word_embeddings", "layers", "attention_bias", "qk_norm", "attn_scale",
          "attn_logit_softcapping", "final_logit_softcapping")


def assert_same_config(got: ModelConfig, want: ModelConfig) -> None:
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        if isinstance(a, float) and isinstance(b, float):
            assert a == pytest.approx(b, rel=1e-6), f
        else:
            assert a == b, (f, a, b)


@pytest.mark.parametrize("size", sorted(GEMMA3))
def test_gemma3_sizes_match_their_hf_configs(size):
    hf = {**GEMMA3_COMMON, **GEMMA3[size]}
    got = ModelConfig.from_gguf(gguf_metadata("gemma3", hf), tensors(tied=True))
    assert_same_config(got, ModelConfig.from_hf(hf))
    assert got.attn_scale == pytest.approx(hf["query_pre_attn_scalar"] ** -0.5, rel=1e-12)
    full = [i for i, spec in enumerate(got.layers) if spec.layer_type == "full_attention"]
    assert full == list(range(5, hf["num_hidden_layers"], 6))
    sliding = got.layers[0]
    assert sliding.sliding_window == hf["sliding_window"]
    assert sliding.rope == {"rope_type": "default", "rope_theta": 10000.0}
    assert got.layers[5].rope["rope_theta"] == 1_000_000.0
    assert got.layers[5].rope["rope_type"] == ("linear" if hf["rope_scaling"] else "default")


def test_gemma3_27b_attention_scale_is_one_over_sqrt_168():
    """Issue 28's repro: 27B metadata gave 1/sqrt(128) = 0.08839."""
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
            "gemma3.attention.key_length": 128, "gemma3.block_count": 62, "gemma3.attention.head_count_kv": 16,
            "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 262144}
    assert ModelConfig.from_gguf(meta).attn_scale == pytest.approx(0.0771517, abs=1e-7)


@pytest.mark.parametrize("arch", sorted(OTHERS))
def test_other_architectures_match_their_hf_configs(arch):
    hf = OTHERS[arch]
    got = ModelConfig.from_gguf(gguf_metadata(arch, hf), tensors(tied=hf["tie_word_embeddings"]))
    assert_same_config(got, ModelConfig.from_hf(hf))
    assert got.attn_scale is None  # head_dim ** -0.5, llama.cpp's 1 / sqrt(n_embd_head_k)


def test_rules_for_fields_the_metadata_lacks():
    base = OTHERS["llama"]
    meta = gguf_metadata("llama", base)
    cfg = hf_config_from_gguf(meta, tensors(tied=False))
    assert cfg["tie_word_embeddings"] is False and "tie_word_embeddings" not in hf_config_from_gguf(meta)
    assert cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False and "sliding_window" not in cfg
    assert hf_config_from_gguf(gguf_metadata("qwen2", OTHERS["qwen2"]))["attention_bias"] is True
    assert ModelConfig.from_gguf(gguf_metadata("qwen3", OTHERS["qwen3"])).qk_norm
    # no key_length: head_dim = hidden / heads; no head_count_kv: MHA
    del meta["llama.attention.key_length"], meta["llama.attention.value_length"], meta["llama.attention.head_count_kv"]
    cfg = hf_config_from_gguf(meta)
    assert cfg["head_dim"] == 64 and cfg["num_key_value_heads"] == 9
    # mistral without a window key: full attention; qwen2 ignores a window key (HF's use_sliding_window=False)
    mistral = ModelConfig.from_gguf(gguf_metadata("mistral", {**OTHERS["mistral"], "sliding_window": None}))
    assert {spec.sliding_window for spec in mistral.layers} == {None}
    qwen2 = ModelConfig.from_gguf({**gguf_metadata("qwen2", OTHERS["qwen2"]), "qwen2.attention.sliding_window": 8})
    assert {spec.sliding_window for spec in qwen2.layers} == {None}
    # vocab from the tokenizer's token count when there is no vocab_size key
    del meta["llama.vocab_size"]
    assert hf_config_from_gguf({**meta, "tokenizer.ggml.tokens.length": 49152})["vocab_size"] == 49152


@pytest.mark.parametrize("change, needles", [
    ({"qwen3.rope.scaling.type": "yarn"}, ["rope.scaling.type='yarn'"]),
    ({"qwen3.rope.dimension_count": 64}, ["rope.dimension_count=64", "128"]),
    ({"qwen3.attention.value_length": 64}, ["value_length=64"]),
    ({"qwen3.embedding_length": None}, ["embedding_length"]),
])
def test_refused_metadata_is_named(change, needles):
    meta = {**gguf_metadata("qwen3", OTHERS["qwen3"]), **change}
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_gguf({k: v for k, v in meta.items() if v is not None})
    for n in needles:
        assert n in str(info.value)


def test_gemma3_without_a_window_is_refused():
    meta = gguf_metadata("gemma3", {**GEMMA3_COMMON, **GEMMA3["1b"]})
    del meta["gemma3.attention.sliding_window"]
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_gguf(meta)


def test_unknown_architecture():
    import re

    from sparrow.config.gguf import GGUF_ARCHITECTURES

    supported = ", ".join(sorted(GGUF_ARCHITECTURES))
    assert {"qwen2moe", "qwen3moe", "gemma4", "llama"} <= set(GGUF_ARCHITECTURES)
    with pytest.raises(UnsupportedArchitectureError, match=f"'phi3'.*supported: {re.escape(supported)}$"):
        hf_config_from_gguf({"general.architecture": "phi3"})


def test_real_files_agree_with_transformers_gguf_config():
    """The packaged SmolLM2 (llama) file: sparrow's mapping and transformers' own GGUF config reader agree."""
    import transformers

    from sparrow.loader.gguf import GGUFCheckpoint
    from tests.helpers import smollm2_gguf

    path = smollm2_gguf()
    ckpt = GGUFCheckpoint(path)
    hf = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    assert_same_config(ModelConfig.from_gguf(ckpt.metadata, ckpt.tensor_names), ModelConfig.from_hf(hf))
