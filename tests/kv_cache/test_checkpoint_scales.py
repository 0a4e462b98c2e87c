"""A checkpoint's FP8 KV-cache scales (compressed-tensors ``self_attn.k_scale`` / ``v_scale``, ModelOpt
``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``) on a tiny random NVFP4 Llama (tests/quant/test_nvfp4.py's
exporter): bound to each layer's LayerKVCache with kv_cache_dtype='fp8', ignored with 'auto' (same tokens as the
checkpoint without them), replaced by calculate_kv_scales' measurement."""
from __future__ import annotations

import json

import pytest
import torch

from sparrow import SamplingParams
from tests.helpers import generate_ids, make_llm
from tests.models._hf_tiny import DENSE, build, prompts
from tests.quant.test_nvfp4 import write_nvfp4

SCALES = {0: (0.02, 0.03), 1: (0.05, 0.011)}


def flat(pairs) -> list[float]:
    return [x for pair in pairs for x in pair]


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt-scales") / "llama"
    build(DENSE, "llama", path)
    return path


def _with_scales(src, dst, layout: str):
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt, _ = write_nvfp4(src, dst, layout)
    plain = dst / "plain"  # the same checkpoint without the scales
    shutil.copytree(ckpt, plain)
    tensors = load_file(str(ckpt / "model.safetensors"))
    for i, (k, v) in SCALES.items():
        for kv, s in (("k", k), ("v", v)):
            name = f"{kv}_proj.{kv}_scale" if layout == "modelopt" else f"{kv}_scale"
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.tensor(s)
    save_file(tensors, str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"].update({"kv_cache_quant_algo": "FP8"} if layout == "modelopt" else {
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}})
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt, plain


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_checkpoint_scales_reach_the_fp8_cache(float_llama, tmp_path, layout):
    ckpt, plain = _with_scales(float_llama, tmp_path, layout)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts()]
    fp8 = make_llm(ckpt, max_model_len=64, kv_cache_dtype="fp8")
    assert flat(fp8.engine.runner.kv_cache.scales()) == pytest.approx([*SCALES[0], *SCALES[1]])
    assert all(len(ids) == 6 for ids in generate_ids(fp8, prompts(), sp))
    auto = make_llm(ckpt, max_model_len=64)
    assert auto.engine.runner.kv_cache.scales() == [(1.0, 1.0)] * 2  # ignored by the model-dtype cache
    assert [o.outputs[0].token_ids for o in auto.generate(ps, sp)] == \
        [o.outputs[0].token_ids for o in make_llm(plain, max_model_len=64).generate(ps, sp)]
    unscaled = make_llm(plain, max_model_len=64, kv_cache_dtype="fp8")
    assert unscaled.engine.runner.kv_cache.scales() == [(1.0, 1.0)] * 2
    calc = make_llm(ckpt, max_model_len=64, kv_cache_dtype="fp8", calculate_kv_scales=True)
    generate_ids(calc, prompts()[:1], SamplingParams(max_tokens=1))
    assert all(a != pytest.approx(b) for a, b in zip(flat(calc.engine.runner.kv_cache.scales()), [*SCALES[0], *SCALES[1]]))
