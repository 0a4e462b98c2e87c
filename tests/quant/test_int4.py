"""int4 W4A16 (``sparrow.quant.int4``, ``sparrow.kernels.gemm.int4``) against the format's own library and documented
formulas, and whole tiny models against transformers.

Oracles:
- compressed-tensors' own ``pack_to_int32`` / ``calculate_qparams`` / ``PackedQuantizationCompressor``
  (compress and decompress) on random tensors: sparrow's packing, quantization (fp32 weights) and
  dequantization are bit-exact with them;
- GPTQ (AutoGPTQ v1 / v2) and AWQ (AutoAWQ GEMM) layouts written here from their documented formulas
  (GPTQ: qweight[k // 8, n] nibble k % 8 = q[n, k], qzeros[g, n // 8] nibble n % 8 = zero - 1 (v1);
  AWQ: word [k, n // 8] nibble i = q[k, 8 (n // 8) + order[i]], order 0 2 4 6 1 3 5 7; w = (q - zero) * scale);
- tiny random Llama (dense) and Qwen3-MoE (per-expert tensors) checkpoints compressed by compressed-tensors
  in the test: sparrow's greedy ids and logprobs (fp32, CPU) equal transformers fp32 running the weights
  compressed-tensors decompresses (``_hf_tiny.compare``: ids up to a near-tie, logprobs within 1e-4).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparrow import SamplingParams
from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm import int4 as int4_kernels
from sparrow.kernels.gemm.int4 import dequantize_int4_ref, pack_int4_ref, quantize_int4_ref, unpack_int4_ref
from sparrow.quant.int4 import AWQ_ORDER, Int4Config, convert
from tests.helpers import make_llm
from tests.models._hf_tiny import BASE, DENSE, FAMILIES, build, compare, hf_greedy, prompts

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the test extra")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

NEW = 8


def ct_scheme(group: int, symmetric: bool) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_compress(w: torch.Tensor, group: int, symmetric: bool, scale_dtype=None):
    """compressed-tensors' own min-max qparams + compressor on w [N, K] -> (compressed dict, decompressed w)."""
    scheme = ct_scheme(group, symmetric)
    wg = w.float().unflatten(-1, (-1, group))
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
    scale = scale.to(scale_dtype or w.dtype)
    c = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return c, PackedQuantizationCompressor.decompress(c, scheme)["weight"]


def ct_config(group: int, symmetric: bool) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                          "weights": ct_scheme(group, symmetric).weights.model_dump(),
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


# ---- pack / unpack / quantize / dequantize -----------------------------------------------------------------

def test_pack_unpack_bit_exact_with_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 8), (5, 40), (2, 7, 64)):
        u = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
        packed = pack_int4_ref(u)
        assert torch.equal(packed, pack_to_int32((u.to(torch.int16) - 8).to(torch.int8), 4))
        assert torch.equal(unpack_int4_ref(packed), u)
    zp = torch.randint(-8, 8, (13, 3), generator=g, dtype=torch.int8)  # zero points: packed along N (13 rows)
    got = convert("compressed-tensors", "zero", pack_to_int32(zp, 4, packed_dim=0), 13, 96, 32, "zp")
    assert torch.equal(got, (zp.to(torch.int16) + 8).to(torch.uint8))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_bit_exact_with_compressed_tensors(group, symmetric, scale_dtype, monkeypatch):
    """Also with rows quantized 5 at a time (``QUANTIZE_CHUNK_CPU``, a short last chunk) and w as [4, 6, K]."""
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(group)) * 0.05
    c, decompressed = ct_compress(w, group, symmetric, scale_dtype)
    zero = convert("compressed-tensors", "zero", c["weight_zero_point"], 24, 256, group, "z") if not symmetric else None
    assert torch.equal(dequantize_int4_ref(c["weight_packed"], c["weight_scale"], zero, group), decompressed)
    if scale_dtype == torch.float32:  # fp32 weights: sparrow's quantizer is compressed-tensors' own, bit for bit
        packed, scale, z = quantize_int4_ref(w, group, symmetric)
        assert torch.equal(packed, c["weight_packed"]) and torch.equal(scale, c["weight_scale"])
        assert (z is None) == symmetric and (symmetric or torch.equal(z, zero))
        monkeypatch.setattr(int4_kernels, "QUANTIZE_CHUNK_CPU", 5 * 256)
        chunked = quantize_int4_ref(w.reshape(4, 6, 256), group, symmetric)
        for got, want in zip(chunked, (packed, scale, z)):
            assert (got is None and want is None) or torch.equal(got, want.reshape(4, 6, -1))


def test_ragged_last_group_round_trip():
    """On-load quantization with K not a multiple of the group (Gemma 4's 704 / 2112): the last group is short;
    every weight is within half a step of its group's scale."""
    w = torch.randn(6, 200, generator=torch.Generator().manual_seed(3))
    packed, scale, _ = quantize_int4_ref(w, 128)
    assert scale.shape == (6, 2)
    err = (dequantize_int4_ref(packed, scale, None, 128) - w).abs()
    assert torch.equal(scale[:, 1], w[:, 128:].abs().amax(-1) / 7.5)  # the short group's own amax
    step = scale.repeat_interleave(128, -1)[:, :200]
    assert bool((err <= step * 0.5 * (1 + 1e-5)).all())  # |w| <= 7.5 steps: a clamp to 7 is half a step too


def _gptq_tensors(u, z, s, group, v1=True):
    """GPTQ layout from the formula: u [N, K] codes, z [N, G] zeros, s [N, G] -> qweight, qzeros, scales, g_idx."""
    n, k = u.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= u.t()[j::8].to(torch.int64) << (4 * j)
    zs = ((z.t().to(torch.int64) - (1 if v1 else 0)) & 0xF)  # [G, N]
    qzeros = torch.zeros(zs.shape[0], n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= zs[:, j::8] << (4 * j)
    as32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)  # noqa: E731
    return as32(qweight), as32(qzeros), s.t().contiguous().half(), torch.arange(k, dtype=torch.int32) // group


def _awq_tensors(u, z, s):
    """AWQ GEMM layout from the formula: word [k, n // 8] nibble i holds column 8 (n // 8) + AWQ_ORDER[i]."""
    def pack(cols):  # [A, N] -> [A, N / 8]
        out = torch.zeros(cols.shape[0], cols.shape[1] // 8, dtype=torch.int64)
        for i, c in enumerate(AWQ_ORDER):
            out |= cols[:, c::8].to(torch.int64) << (4 * i)
        return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return pack(u.t()), pack(z.t()), s.t().contiguous().half()


@pytest.mark.parametrize("group", [32, 128])
def test_gptq_and_awq_layouts_from_their_formulas(group):
    gen = torch.Generator().manual_seed(1)
    n, k = 24, 256
    u = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    z = torch.randint(1, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=gen).half() * 0.01
    want = ((u.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)).half()
    for layout, tensors in (("gptq", _gptq_tensors(u, z, s, group)), ("awq", _awq_tensors(u, z, s))):
        packed, zero, scale = (convert(layout, kind, t, n, k, group, kind) for kind, t in
                               zip(("packed", "zero", "scale"), tensors))
        assert torch.equal(dequantize_int4_ref(packed, scale, zero, group), want), layout
    qweight, qzeros, scales, g_idx = _gptq_tensors(u, z, s, group, v1=False)
    zero = convert("gptq", "zero", qzeros, n, k, group, "qzeros", gptq_v1=False)
    assert torch.equal(zero, z)
    with pytest.raises(ModelLoadError, match="activation order"):
        convert("gptq", "g_idx", g_idx.flip(0), n, k, group, "layers.0.qkv.g_idx")
    with pytest.raises(ModelLoadError, match=f"has {k - 1} entries; a GPTQ g_idx has one per input column"):
        convert("gptq", "g_idx", g_idx[1:], n, k, group, "layers.0.qkv.g_idx")
    other = 32 if group != 32 else 64
    with pytest.raises(ModelLoadError, match=f"g_idx of group size {other}, but the checkpoint's config says "
                                             f"group_size {group}"):
        convert("gptq", "g_idx", torch.arange(k, dtype=torch.int32) // other, n, k, group, "layers.0.qkv.g_idx")


def test_config_errors_are_named():
    with pytest.raises(ModelLoadError, match="desc_act=true"):
        Int4Config.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    with pytest.raises(ModelLoadError, match="bits=8"):
        Int4Config.from_hf({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ModelLoadError, match="group_size=16"):
        Int4Config.from_hf({"quant_method": "awq", "bits": 4, "group_size": 16})
    with pytest.raises(ModelLoadError, match="lm_head=true"):  # GPTQModel's quantized LM head
        Int4Config.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True})
    with pytest.raises(ModelLoadError, match="dynamic"):  # GPTQModel's per-module overrides
        Int4Config.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down_proj": {}}})
    qc = ct_config(128, True)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(ModelLoadError, match="actorder"):
        Int4Config.from_hf(qc)
    from sparrow.quant import config_from_hf

    assert isinstance(config_from_hf(ct_config(64, False)), Int4Config)
    assert config_from_hf({"quant_method": "awq", "bits": 4, "group_size": 128}).layout == "awq"
    assert config_from_hf({"quant_method": "GPTQ", "bits": 4, "group_size": 128}).layout == "gptq"  # any case
    assert config_from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": None}).layout == "gptq"
    with pytest.raises(ModelLoadError, match=r"desc_act='false' must be true or false"):
        Int4Config.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "false"})
    qc = ct_config(128, True)
    qc["config_groups"]["group_0"]["weights"] = "int4"
    with pytest.raises(ModelLoadError, match=r"config_groups.group_0.weights must be an object.*'int4'"):
        Int4Config.from_hf(qc)


def test_weight_activation_order_loads_and_malformed_groups_are_named():
    """actorder "weight" (compressed-tensors' name for "static"; llm-compressor's GPTQ writes it) orders the
    calibration only: the checkpoint is plain pack-quantized. A config_groups that is not an object of objects is
    a ModelLoadError naming it."""
    from sparrow.quant import config_from_hf

    for order in ("weight", "static"):
        qc = ct_config(128, True)
        qc["config_groups"]["group_0"]["weights"]["actorder"] = order
        assert config_from_hf(qc) == config_from_hf(ct_config(128, True)), order
    for groups in ([ct_config(128, True)["config_groups"]["group_0"]], {"group_0": "pack-quantized"}):
        with pytest.raises(ModelLoadError, match="config_groups"):
            config_from_hf({**ct_config(128, True), "config_groups": groups})


def _transform_config(*locations) -> dict:
    """compressed-tensors' transform_config of one Hadamard scheme applied at ``locations`` (its model_dump)."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    apply = [TransformArgs(targets=["Linear"], location=loc) for loc in locations]
    return TransformConfig(config_groups={"u": TransformScheme(type="hadamard", apply=apply)}).model_dump(mode="json")


def test_online_transforms_and_sparse_compression_are_refused():
    """compressed-tensors checkpoints whose transform_config rotates activations at run time (QuIP / SpinQuant
    online Hadamards) or whose sparsity_config compresses the weights (2:4 bitmask) would run wrong if loaded as
    plain pack-quantized: refused by name. Rotations fused into the weights (weight_input / weight_output) and
    the empty entries compressed-tensors writes load."""
    from sparrow.quant import config_from_hf
    from sparrow.quant.nvfp4 import Nvfp4Config

    plain = config_from_hf(ct_config(128, True))
    for extra in ({"transform_config": {}, "sparsity_config": {}},
                  {"transform_config": _transform_config("weight_input", "weight_output")},
                  {"sparsity_config": {"format": "dense", "sparsity_structure": "2:4"}}):
        assert config_from_hf({**ct_config(128, True), **extra}) == plain, extra
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    for qc in (ct_config(128, True), nvfp4):
        with pytest.raises(ModelLoadError, match="transform_config .*'input'.* online"):
            config_from_hf({**qc, "transform_config": _transform_config("weight_input", "input")})
        with pytest.raises(ModelLoadError, match="sparsity_config .*'sparse-24-bitmask'"):
            config_from_hf({**qc, "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}})
    assert isinstance(config_from_hf(nvfp4), Nvfp4Config)


def test_fp8_kv_cache_scales_are_skipped():
    """A pack-quantized config with an FP8 ``kv_cache_scheme`` skips the checkpoint's ``self_attn.k_scale`` /
    ``v_scale`` (the KV cache is in the model dtype; whole models: tests/quant/test_nvfp4.py); without one they
    are read (and refused as unused)."""
    from sparrow.quant import config_from_hf

    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    cfg = config_from_hf({**ct_config(128, True), "kv_cache_scheme": kv})
    assert cfg.skips_tensor("model.layers.0.self_attn.k_scale") and cfg.skips_tensor("model.layers.3.self_attn.v_scale")
    assert not cfg.skips_tensor("model.layers.0.self_attn.o_proj.weight_scale")
    assert not config_from_hf(ct_config(128, True)).skips_tensor("model.layers.0.self_attn.k_scale")


# ---- whole models ----------------------------------------------------------------------------------------

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_ct_checkpoint(hf, dst: Path, group: int, symmetric: bool, float_modules=(), targets=None):
    """hf's weights compressed by compressed-tensors into a pack-quantized checkpoint at ``dst`` (per-expert
    tensors for fused 3-D experts); loads the decompressed weights back into ``hf`` (the oracle).
    ``float_modules``: HF module names (``model.layers.0.mlp.experts.3.up_proj``) written in float and listed in
    ``ignore``, as llm-compressor lists them; with ``targets`` (the config group's) they are only left out."""
    from safetensors.torch import save_file

    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    out, oracle = {}, dict(sd)
    for name, t in sd.items():
        parts = name.split(".")
        if parts[-1] == "weight" and parts[-2] in _LINEARS and name[:-len(".weight")] not in float_modules:
            c, oracle[name] = ct_compress(t, group, symmetric)
            out.update({f"{name[:-len('weight')]}{k}": v for k, v in c.items()})
        elif ".experts." in name and parts[-1] in ("gate_up_proj", "down_proj"):
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                halves = t[e].chunk(2) if parts[-1] == "gate_up_proj" else (t[e],)
                names = ("gate_proj", "up_proj") if parts[-1] == "gate_up_proj" else ("down_proj",)
                for half, (proj, w) in enumerate(zip(names, halves)):
                    base = f"{'.'.join(parts[:-1])}.{e}.{proj}"
                    c, d = ({"weight": w.contiguous()}, w) if base in float_modules else \
                        ct_compress(w.contiguous(), group, symmetric)
                    rows = w.shape[0]
                    deq[e, half * rows:(half + 1) * rows] = d
                    out.update({f"{base}.{k}": v for k, v in c.items()})
            oracle[name] = deq
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = ct_config(group, symmetric)
    if targets is not None:
        cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = list(targets)
    else:
        cfg["quantization_config"]["ignore"] += list(float_modules)
    (dst / "config.json").write_text(json.dumps(cfg))
    hf.load_state_dict(oracle)
    return dst


def _run_and_compare(path: Path, hf, **llm_kw):
    llm = make_llm(path, max_model_len=64, **llm_kw)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
    compared = 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    for p, o in zip(prompts(), outs):
        ids, logits = hf_greedy(hf, p, NEW)
        compared += compare(ids, logits, o.outputs[0])
    assert compared >= NEW, f"only {compared} steps free of near-ties"
    return llm


@pytest.mark.parametrize("family,group,symmetric", [("llama", 64, True), ("qwen3_moe", 32, False)])
def test_ct_checkpoint_matches_transformers_on_decompressed_weights(family, group, symmetric, tmp_path):
    table = DENSE if family in DENSE else FAMILIES
    over = dict(intermediate_size=128, moe_intermediate_size=32) if family == "qwen3_moe" else dict(intermediate_size=128)
    hf = build(table, family, tmp_path / "float", **over)
    path = write_ct_checkpoint(hf, tmp_path / "ct", group, symmetric)
    llm = _run_and_compare(path, hf)
    model = llm.engine.runner.model
    layer0 = model.model.layers[0]
    assert layer0.self_attn.qkv_proj.weight_packed.dtype == torch.int32
    assert (layer0.self_attn.qkv_proj.weight_zero is None) == symmetric
    if family == "qwen3_moe":
        experts = layer0.mlp.experts
        assert experts.gate_up_proj.dtype == torch.int32 and experts.gate_up_proj.shape == (8, 64, BASE["hidden_size"] // 8)
        assert layer0.mlp.gate.weight.dtype == torch.float32


def test_float_modules_named_as_llm_compressor_names_them(tmp_path):
    """Layers left float in a pack-quantized checkpoint, named the ways llm-compressor writes them: every expert
    linear of layer 0's experts in ``ignore`` (Qwen3-MoE, per-expert names), or a config group whose
    ``targets`` name only the attention projections (Llama, MLPs float). Both run as transformers does on the
    decompressed + float weights (ids, logprobs within 1e-4); the float layers hold float weights."""
    hf = build(FAMILIES, "qwen3_moe", tmp_path / "moe", intermediate_size=128, moe_intermediate_size=32)
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
    model = _run_and_compare(write_ct_checkpoint(hf, tmp_path / "moe_ct", 32, True, experts), hf).engine.runner.model
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    assert model.model.layers[2].mlp.experts.gate_up_proj.dtype == torch.int32
    hf = build(DENSE, "llama", tmp_path / "dense", intermediate_size=128)
    mlps = [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    path = write_ct_checkpoint(hf, tmp_path / "dense_ct", 64, False, mlps, targets=["re:.*self_attn.*"])
    layer = _run_and_compare(path, hf).engine.runner.model.model.layers[1]
    assert layer.self_attn.o_proj.weight_packed.dtype == torch.int32
    assert layer.mlp.down_proj.weight.dtype == torch.float32


def test_float_layer_the_config_does_not_name_is_named(tmp_path):
    """A float weight in a pack-quantized checkpoint for a layer (a Linear, per-expert linears of stacked experts)
    its quantization_config leaves int4: the error names the tensor, the int4 tensors the layer takes and the
    config fields that leave a layer float."""
    hf = build(DENSE, "llama", tmp_path / "dense", intermediate_size=128)
    path = write_ct_checkpoint(hf, tmp_path / "ct", 64, True, ["model.layers.1.mlp.down_proj"])
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"].remove("model.layers.1.mlp.down_proj")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.down_proj.weight' is a float weight, but "
                                             r"'model.layers.1.mlp.down_proj' takes int4 tensors \['weight_packed', "
                                             r"'weight_scale', 'weight_shape'\].*ignore"):
        make_llm(path, max_model_len=64)
    hf = build(FAMILIES, "qwen3_moe", tmp_path / "moe", intermediate_size=128, moe_intermediate_size=32)
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
    path = write_ct_checkpoint(hf, tmp_path / "moe_ct", 32, True, experts)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"experts.0.\w+_proj.weight' is a float weight, but "
                                             r"'model.layers.0.mlp.experts' takes int4 tensors"):
        make_llm(path, max_model_len=64)


def test_int4_tensors_the_config_does_not_declare_are_named(tmp_path):
    """int4 tensors of a layer the quantization_config leaves float (its ignore list names it), zero points under
    ``symmetric: true``, an integer scale, int4 tensors in a float checkpoint quantized to FP8 at load: each error
    names the tensor, the layer and the cause."""
    hf = build(DENSE, "llama", tmp_path / "dense", intermediate_size=128)
    path = write_ct_checkpoint(hf, tmp_path / "ct", 64, False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.1.mlp.down_proj")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.down_proj.weight_\w+' is .*, but "
                                             r"'model.layers.1.mlp.down_proj' is a float layer of "
                                             r"LlamaForCausalLM: .* leaves it in float \(its ignore list"):
        make_llm(path, max_model_len=64)
    cfg["quantization_config"]["ignore"].remove("model.layers.1.mlp.down_proj")
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"weight_zero_point' is int4 zero points, but 'model.layers.0.\S+' "
                                             r"takes the int4 tensors .* does not declare int4 zero points for it"):
        make_llm(path, max_model_len=64)
    from safetensors.torch import load_file, save_file

    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"'{name}' is torch.int32, but .* of the int4 layer "
                                             r"'model.layers.0.mlp.down_proj' is torch.float32"):
        make_llm(path, max_model_len=64)
    hf.save_pretrained(tmp_path / "float")  # int4 tensors in a float checkpoint quantized to FP8 at load
    tensors = load_file(str(tmp_path / "float" / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight_packed"] = torch.zeros(64, 8, dtype=torch.int32)
    save_file(tensors, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"o_proj.weight_packed' is an int4 packed weight, but LlamaForCausalLM "
                                             r"has no int4 parameter .*config.json lacks an int4 quantization_config"):
        make_llm(tmp_path / "float", max_model_len=64, quantization="fp8")


def test_widths_int4_cannot_pack_name_the_layer_and_ignored_ones_load(tmp_path):
    """In features not a multiple of 8: on-load int4 names the layer (dense; experts); a checkpoint whose ignore
    list leaves those layers float loads them in float and matches transformers."""
    hf = build(DENSE, "llama", tmp_path / "dense", intermediate_size=100)
    with pytest.raises(ModelLoadError, match=r"divisible by 8: 'model.layers.0.mlp.down_proj' has 100"):
        make_llm(tmp_path / "dense", max_model_len=64, quantization="int4")
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    path = write_ct_checkpoint(hf, tmp_path / "ct", 32, True, downs)
    layer = _run_and_compare(path, hf).engine.runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight.is_floating_point() and layer.mlp.gate_up_proj.weight_packed.dtype == torch.int32
    build(FAMILIES, "qwen3_moe", tmp_path / "moe", intermediate_size=128, moe_intermediate_size=20)
    with pytest.raises(ModelLoadError, match=r"divisible by 8: 'model.layers.0.mlp.experts' has 64 and 20"):
        make_llm(tmp_path / "moe", max_model_len=64, quantization="int4")


def test_ignore_naming_some_experts_or_projections_is_named(tmp_path):
    hf = build(FAMILIES, "qwen3_moe", tmp_path / "moe", intermediate_size=128, moe_intermediate_size=32)
    some = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    with pytest.raises(ModelLoadError, match="only some .* 'model.layers.0.mlp.experts'"):
        make_llm(write_ct_checkpoint(hf, tmp_path / "ct", 32, True, some), max_model_len=64)
    with pytest.raises(ModelLoadError, match="only some .* 'model.layers.1.self_attn.qkv_proj'"):
        make_llm(write_ct_checkpoint(hf, tmp_path / "ct2", 32, True, ["model.layers.1.self_attn.k_proj"]))


def test_on_load_int4_equals_compressed_tensors_checkpoint(tmp_path):
    """``quantization="int4"`` (symmetric, group 128) on a float Qwen3-MoE gives the parameters of the
    checkpoint compressed-tensors makes from the same weights, and runs as transformers on its decompression."""
    over = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, head_dim=32)
    hf = build(FAMILIES, "qwen3_moe", tmp_path / "float", **over)
    got = make_llm(tmp_path / "float", max_model_len=64, quantization="int4").engine.runner.model
    path = write_ct_checkpoint(hf, tmp_path / "ct", 128, True)
    want = _run_and_compare(path, hf).engine.runner.model
    got_p, want_p = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_p.keys() == want_p.keys()
    for name, p in got_p.items():
        assert p.dtype == want_p[name].dtype and torch.equal(p, want_p[name]), name


def test_gptq_and_awq_checkpoints_load_as_the_ct_one(tmp_path):
    """The same codes written as GPTQ (v1; with and without the g_idx tensors, which desc_act=false makes
    k // group) and AWQ checkpoints load to sparrow parameters equal to the compressed-tensors checkpoint's
    (scales rounded to fp16, as those formats store them), with ``quantization=`` their quant_method in any case
    (vLLM's ``quantization="AWQ"``); another checkpoint format's name, or one on a float checkpoint, is refused.
    Checkpoints that keep the config in AutoGPTQ's quantize_config.json / AutoAWQ's quant_config.json (its w_bit /
    q_group_size keys) rather than in config.json load the same."""
    from sparrow.errors import InvalidRequestError

    from safetensors.torch import load_file, save_file

    hf = build(DENSE, "llama", tmp_path / "float", intermediate_size=128)
    ct_dir = write_ct_checkpoint(hf, tmp_path / "ct", 32, False)
    ct_tensors = load_file(str(ct_dir / "model.safetensors"))
    ref = dict(make_llm(ct_dir, max_model_len=64).engine.runner.model.named_parameters())
    legacy = {"gptq-quantize_config.json": {"bits": 4, "group_size": 32, "desc_act": False, "sym": False},
              "awq-quant_config.json": {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}}
    for layout in ("gptq", "awq", "gptq-no-g_idx", *legacy):
        method = layout.split("-")[0]
        out = {}
        for name, t in ct_tensors.items():
            if not name.endswith("weight_packed"):
                if not name.rpartition(".")[2].startswith("weight_"):
                    out[name] = t
                continue
            base = name[:-len("weight_packed")]
            n, k = ct_tensors[base + "weight_shape"].tolist()
            u = unpack_int4_ref(t)
            z = convert("compressed-tensors", "zero", ct_tensors[base + "weight_zero_point"], n, k, 32, base)
            s = ct_tensors[base + "weight_scale"].half()
            names = ("qweight", "qzeros", "scales", "g_idx")[:3 if layout in ("awq", "gptq-no-g_idx") else 4]
            ts = _gptq_tensors(u, z, s, 32) if method == "gptq" else _awq_tensors(u, z, s)
            out.update({base + nm: v for nm, v in zip(names, ts)})
        dst = tmp_path / layout
        dst.mkdir()
        save_file(out, str(dst / "model.safetensors"))
        cfg = json.loads((ct_dir / "config.json").read_text())
        if layout in legacy:
            (dst / layout.split("-")[1]).write_text(json.dumps(legacy[layout]))
            del cfg["quantization_config"]
        else:
            cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32, "desc_act": False,
                                          "sym": False, "zero_point": True, "version": "gemm"}
        (dst / "config.json").write_text(json.dumps(cfg))
        got = dict(make_llm(dst, max_model_len=64, quantization=method.upper()).engine.runner.model
                   .named_parameters())
        assert got.keys() == ref.keys(), layout
        for name, p in got.items():
            want = ref[name].half() if name.endswith("weight_scale") else ref[name]
            assert torch.equal(p, want), (layout, name)
    with pytest.raises(InvalidRequestError, match="quantization='awq' does not match .* pass quantization=None or "
                                                  "'int4' or 'gptq'"):
        make_llm(tmp_path / "gptq", quantization="awq")
    with pytest.raises(InvalidRequestError, match="quantization='gptq' names a checkpoint format"):
        make_llm(tmp_path / "float", quantization="gptq")


def test_bench_named_shape_quantizes_to_int4(tmp_path):
    """``sparrow bench --model-shape tiny-gemma4 --quantization int4``: the random bf16 weights quantize at load
    (widths below the group: one short group per row) and a step reads fewer weight bytes than in bf16."""
    from sparrow.cli import main

    runs = {}
    for name, extra in (("bf16", ()), ("int4", ("--quantization", "int4"))):
        out = tmp_path / f"{name}.json"
        assert main(["bench", "--device", "cpu", "--batch-sizes", "1", "--prompt-len", "5", "--decode-tokens", "2",
                     "--model-shape", "tiny-gemma4", "--no-hf", "--out", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert all("error" not in r and r["decode_tok_s"] > 0 for r in runs["int4"]["results"]), runs["int4"]["results"]
    wb = {k: sum(r["meta"]["bytes_model"]["weight_bytes"].values()) for k, r in runs.items()}
    assert wb["int4"] < wb["bf16"]
