"""NVFP4 weights (sparrow.quant.nvfp4, sparrow.kernels.gemm.nvfp4) against the format's own libraries, CPU fp32.

Oracles: compressed-tensors' NVFP4 compressor (its observer formulas ``generate_gparam`` /
``calculate_qparams``, ``NVFP4PackedCompressor.compress`` / ``decompress``, ``pack_fp4_to_uint8``) for pack /
quantize / dequantize, bit-exact on random tensors; ModelOpt's layout written here from its documented formula
(``NVFP4QTensor``: weight_scale_2 = amax / (6 * 448), per-16 scale = e4m3(amax16 / (6 * weight_scale_2)),
codes = e2m1(w / (scale * weight_scale_2)), dequantize e2m1 * (scale * weight_scale_2), low nibble first).
Tiny random checkpoints of a dense family (Llama) and an MoE family (Qwen3-MoE, per-expert tensors) are written
in both layouts; sparrow's greedy ids and logprobs equal transformers fp32 running the weights as the format
decompresses them (ids up to the first near-tie, logprobs within 1e-4: tests/models/_hf_tiny.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparrow import SamplingParams
from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.nvfp4 import (
    dequantize_nvfp4_ref,
    e2m1_codes_ref,
    pack_nvfp4_ref,
    quantize_nvfp4_ref,
    unpack_nvfp4_ref,
)
from tests.helpers import make_llm
from tests.models._hf_tiny import DENSE, FAMILIES, build, compare, hf_greedy, prompts

NEW = 8
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the formats' own quantizers ----------------------------------------------------------------------------

def ct_compress(w: torch.Tensor) -> dict:
    """compressed-tensors' NVFP4A16 weight: its global scale and group scales from the min / max of the tensor
    and of each group of 16 (its observer), then its compressor."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    gs = generate_gparam(w.amin(), w.amax())
    groups = w.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)


def ct_decompress(sd: dict) -> torch.Tensor:
    """compressed-tensors' dequantization formula in fp32 (its ``_dequantize``: x_q * (scale / global_scale))."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize

    packed = sd["weight_packed"]
    m, n = packed.shape
    x_q = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32).unflatten(-1, (-1, 16))
    scale = sd["weight_scale"].float().unsqueeze(-1)
    return _dequantize(x_q, scale, global_scale=sd["weight_global_scale"]).flatten(-2)


_MO_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])


def modelopt_quantize(w: torch.Tensor) -> dict:
    """ModelOpt's documented NVFP4 export of one weight (NVFP4QTensor.get_weights_scaling_factor_2 /
    get_weights_scaling_factor / quantize / _cast_fp4)."""
    w = w.float()
    g2 = w.abs().amax() / (6.0 * 448.0)
    blocks = w.unflatten(-1, (-1, 16))
    per_block = blocks.abs().amax(-1) / (6.0 * g2)
    per_block[per_block == 0] = 1.0
    scale = per_block.clamp(min=2 ** -9).to(torch.float8_e4m3fn)
    x = (blocks / (scale.float() * g2).unsqueeze(-1)).flatten(-2)
    mag = x.abs()
    ordinal = torch.searchsorted(_MO_BOUNDS, mag.contiguous(), out_int32=True).to(torch.uint8)
    odd = ((mag == 0.75) | (mag == 1.75) | (mag == 2.5)).to(torch.uint8)
    q = ((x < 0).to(torch.uint8) << 3) + ordinal + odd
    return {"weight": (q[..., 1::2] << 4) | q[..., 0::2], "weight_scale": scale, "weight_scale_2": g2.reshape(()),
            "input_scale": torch.tensor(0.5)}


_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def modelopt_dequantize(sd: dict) -> torch.Tensor:
    """ModelOpt's NVFP4QTensor.dequantize: codes (low nibble first) * (scale * weight_scale_2) per 16."""
    p = sd["weight"]
    codes = torch.empty(*p.shape[:-1], p.shape[-1] * 2, dtype=torch.long)
    codes[..., 0::2], codes[..., 1::2] = p & 0x0F, p >> 4
    per_block = sd["weight_scale"].float() * sd["weight_scale_2"]
    return (_E2M1[codes].unflatten(-1, (-1, 16)) * per_block.unsqueeze(-1)).flatten(-2)


# ---- references against the libraries -------------------------------------------------------------------

def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * 0.05
    w[3, :16] = 0.0  # an all-zero group
    w[5, 16:32] *= 1e-6  # a tiny group (its scale underflows e4m3's range)
    w[7, 2] = 0.7  # the tensor amax
    return [w, torch.randn(16, 64, generator=g) * 3.0, torch.rand(8, 32, generator=g) - 0.2]


def test_codes_and_packing_equal_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    halfway = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5])
    x = torch.cat([halfway, -halfway, torch.tensor([0.0, -0.0, -0.1, 0.26, 0.74, 100.0, -7.0, 4.9]),
                   torch.randn(4 * 64 - 24, generator=torch.Generator().manual_seed(1)) * 3]).reshape(4, 64)
    want = pack_fp4_to_uint8(cast_to_fp4(x.clone()).clamp(-6, 6))
    got = pack_nvfp4_ref(e2m1_codes_ref(x))
    assert torch.equal(got, want)
    assert torch.equal(unpack_fp4_from_uint8(got, 4, 64, dtype=torch.float32),
                       dequantize_nvfp4_ref(got, torch.ones(4, 4, dtype=torch.float8_e4m3fn), torch.ones(())))
    assert torch.equal(pack_nvfp4_ref(unpack_nvfp4_ref(got)), got)


@pytest.mark.parametrize("which", range(3))
def test_quantize_and_dequantize_equal_compressed_tensors(which):
    w = _weights()[which]
    want = ct_compress(w)
    packed, scale, gs = quantize_nvfp4_ref(w, "compressed-tensors")
    assert torch.equal(packed, want["weight_packed"])
    assert torch.equal(scale.view(torch.uint8), want["weight_scale"].view(torch.uint8))
    assert torch.equal(gs, want["weight_global_scale"])
    deq = dequantize_nvfp4_ref(packed, scale, gs, divide_global=True)
    assert torch.equal(deq, ct_decompress(want))
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    lib = NVFP4PackedCompressor.decompress(want, QuantizationScheme(targets=["Linear"], **NVFP4A16))["weight"]
    assert torch.equal(deq.to(lib.dtype), lib)  # the library's own decompress (it returns bf16)


@pytest.mark.parametrize("which", range(3))
def test_quantize_and_dequantize_equal_modelopt_formula(which):
    w = _weights()[which]
    want = modelopt_quantize(w)
    packed, scale, g2 = quantize_nvfp4_ref(w, "modelopt")
    assert torch.equal(packed, want["weight"])
    assert torch.equal(scale.view(torch.uint8), want["weight_scale"].view(torch.uint8))
    assert torch.equal(g2.reshape(()), want["weight_scale_2"])
    assert torch.equal(dequantize_nvfp4_ref(packed, scale, g2), modelopt_dequantize(want))
    # round trip: within half an e2m1 step of the group's scale
    deq = dequantize_nvfp4_ref(packed, scale, g2)
    step = (scale.float() * g2).repeat_interleave(16, dim=1)
    assert bool(((deq - w).abs() <= step + 1e-12).all())


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors"])
def test_all_zero_weight_quantizes_to_zeros(convention):
    """A weight of zeros (a zeroed projection or expert): codes 0, finite scales, dequantized zeros, not NaN
    (ModelOpt's global amax / 2688 is 0 there, and each group's scale 0 / 0)."""
    packed, scale, g = quantize_nvfp4_ref(torch.zeros(4, 32), convention)
    assert not packed.any() and bool(torch.isfinite(scale.float()).all()) and bool((g > 0).all())
    assert torch.equal(dequantize_nvfp4_ref(packed, scale, g, divide_global=convention != "modelopt"),
                       torch.zeros(4, 32))


# ---- checkpoints ----------------------------------------------------------------------------------------

def _quantized(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "weight" and parts[-2] in _LINEARS and ".mlp.gate." not in name


def write_nvfp4(src: Path, dst: Path, layout: str, ignore: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """(the NVFP4 checkpoint of ``src`` in ``layout``, the float oracle checkpoint holding its weights as the
    format decompresses them). ``ignore``: HF module names left float (listed in the config)."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out, oracle = {}, {}
    for name, t in tensors.items():
        module = name.rpartition(".")[0]
        if not _quantized(name) or module in ignore:
            out[name] = oracle[name] = t
            continue
        if layout == "modelopt":
            sd = modelopt_quantize(t)
            oracle[name] = modelopt_dequantize(sd)
        else:
            sd = ct_compress(t)
            oracle[name] = ct_decompress(sd)
        out.update({f"{module}.{k}": v for k, v in sd.items()})
    cfg = json.loads((src / "config.json").read_text())
    paths = []
    for folder, ts, qc in ((dst / "nvfp4", out, _quant_config(layout, ignore)), (dst / "oracle", oracle, None)):
        folder.mkdir(parents=True)
        save_file(ts, str(folder / "model.safetensors"))
        c = dict(cfg)
        if qc is not None:
            c["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(c))
        paths.append(folder)
    return paths[0], paths[1]


def _quant_config(layout: str, ignore) -> dict:
    if layout == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "ignore": ["lm_head", "model.layers.*.mlp.gate", *ignore]}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                      "group_size": 16, "symmetric": True, "dynamic": False}}},
            "ignore": ["lm_head", "re:.*mlp.gate$", *ignore]}


def _agree_with_transformers(path: Path, oracle: Path):
    """sparrow on ``path`` against transformers on ``oracle`` (greedy ids, logprobs); returns sparrow's LLM."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    llm = make_llm(path, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
    compared = 0
    for p in prompts((5, 19)):
        ids, logits = hf_greedy(hf, p, NEW)
        compared += compare(ids, logits, llm.generate({"prompt_token_ids": p}, params)[0].outputs[0])
    assert compared >= NEW, f"only {compared} steps free of near-ties"
    return llm


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    build(DENSE, "llama", root / "llama")
    build(FAMILIES, "qwen3_moe", root / "qwen3_moe", moe_intermediate_size=32)
    return root


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_dense_checkpoint_equals_transformers_on_decompressed_weights(float_dirs, tmp_path, layout):
    ckpt, oracle = write_nvfp4(float_dirs / "llama", tmp_path, layout, ignore=("model.layers.1.self_attn.o_proj",))
    llm = _agree_with_transformers(ckpt, oracle)
    layers = llm.engine.runner.model.model.layers
    codes = "weight" if layout == "modelopt" else "weight_packed"
    assert getattr(layers[0].self_attn.qkv_proj, codes).dtype == torch.uint8
    assert layers[1].self_attn.o_proj.weight.dtype == torch.float32  # ignored: float


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_moe_checkpoint_equals_transformers_on_decompressed_weights(float_dirs, tmp_path, layout):
    ckpt, oracle = write_nvfp4(float_dirs / "qwen3_moe", tmp_path, layout)
    llm = _agree_with_transformers(ckpt, oracle)
    layer0 = llm.engine.runner.model.model.layers[0]
    assert layer0.mlp.experts.gate_up_proj.dtype == torch.uint8
    assert layer0.mlp.gate.weight.dtype == torch.float32  # the router stays float


def test_modelopt_hf_quant_config_file(float_dirs, tmp_path):
    """An export with hf_quant_config.json instead of config.json's quantization_config loads the same."""
    ckpt, oracle = write_nvfp4(float_dirs / "llama", tmp_path, "modelopt")
    cfg = json.loads((ckpt / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": qc["quant_algo"], "group_size": 16, "exclude_modules": qc["ignore"]}}))
    _agree_with_transformers(ckpt, oracle)


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_fp8_kv_cache_scales_are_skipped(float_dirs, tmp_path, layout):
    """A checkpoint exported with an FP8 KV cache (ModelOpt ``kv_cache_quant_algo: FP8``: ``self_attn.k_proj.k_scale``
    / ``v_proj.v_scale``; compressed-tensors ``kv_cache_scheme``: ``self_attn.k_scale`` / ``v_scale``) loads, its KV
    cache in the model dtype, and runs as transformers on the decompressed weights; the same scales without the
    config's KV-cache entry stay an unused-tensor error."""
    from safetensors.torch import load_file, save_file

    ckpt, oracle = write_nvfp4(float_dirs / "llama", tmp_path, layout)
    tensors = load_file(str(ckpt / "model.safetensors"))
    for i in range(2):
        for kv in "kv":
            name = f"{kv}_proj.{kv}_scale" if layout == "modelopt" else f"{kv}_scale"
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.tensor(0.02)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="k_scale"):
        make_llm(ckpt, max_model_len=64)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"].update({"kv_cache_quant_algo": "FP8"} if layout == "modelopt" else {
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}})
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _agree_with_transformers(ckpt, oracle)


def test_on_load_quantization_equals_the_modelopt_checkpoint(float_dirs, tmp_path):
    """``quantization="nvfp4"`` on the float checkpoint gives the parameters of the ModelOpt export."""
    ckpt, _ = write_nvfp4(float_dirs / "qwen3_moe", tmp_path, "modelopt")
    got = dict(make_llm(float_dirs / "qwen3_moe", max_model_len=64, quantization="nvfp4")
               .engine.runner.model.named_parameters())
    want = dict(make_llm(ckpt, max_model_len=64).engine.runner.model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        if name.endswith("input_scale"):  # not made by on-load quantization (unused on Hopper)
            continue
        assert p.dtype == want[name].dtype, name
        assert torch.equal(p.view(torch.uint8) if p.element_size() == 1 else p,
                           want[name].view(torch.uint8) if p.element_size() == 1 else want[name]), name


def test_bad_checkpoints_are_named(float_dirs, tmp_path):
    ckpt, _ = write_nvfp4(float_dirs / "llama", tmp_path, "modelopt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "W4A8_AWQ"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quant_algo='W4A8_AWQ' is not supported"):
        make_llm(ckpt)
    cfg["quantization_config"]["quant_algo"] = "NVFP4"
    cfg["quantization_config"]["ignore"] = ["model.layers.0.self_attn.q_proj"]  # part of packed qkv_proj
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="packed into 'model.layers.0.self_attn.qkv_proj'"):
        make_llm(ckpt)
    from safetensors.torch import load_file, save_file

    cfg["quantization_config"]["ignore"] = []
    (ckpt / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(ckpt / "model.safetensors"))
    for proj in ("o_proj", "q_proj"):  # a layer of its own; a shard of the packed qkv_proj
        save_file({k: v for k, v in tensors.items() if k != f"model.layers.0.self_attn.{proj}.weight_scale_2"},
                  str(ckpt / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=rf"lacks the tensor .*{proj}.weight_scale_2.*expected shape \(\) "
                                                 r"\(a scalar\)"):
            make_llm(ckpt)
    ckpt, _ = write_nvfp4(float_dirs / "llama", tmp_path / "ct", "compressed-tensors")  # a [1] tensor there
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_global_scale"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks the tensor .*o_proj.weight_global_scale.*expected shape \(1,\)"):
        make_llm(ckpt)


def test_on_load_experts_of_an_unpackable_width_are_named(tmp_path):
    build(FAMILIES, "qwen3_moe", tmp_path / "moe", intermediate_size=128, moe_intermediate_size=24)
    with pytest.raises(ModelLoadError, match=r"the experts 'model.layers.0.mlp.experts' of hidden size 64 and width "
                                             r"24 are not multiples of 16"):
        make_llm(tmp_path / "moe", max_model_len=64, quantization="nvfp4")


def test_linear_kernel_path_matches_torch_path(float_dirs, tmp_path):
    """A loaded compressed-tensors linear (qkv_proj: three shards, three global scales) computes under
    ``backend("triton")`` (the interpreter here) what the torch path does: NMSE < 1e-10 (fp32)."""
    from sparrow.kernels import backend

    ckpt, _ = write_nvfp4(float_dirs / "llama", tmp_path, "compressed-tensors")
    layer = make_llm(ckpt, max_model_len=64).engine.runner.model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    want = layer(x)
    with backend("triton"):
        got = layer(x)
    nmse = float(((got - want) ** 2).sum() / (want ** 2).sum())
    assert nmse < 1e-10, nmse
