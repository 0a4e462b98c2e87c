"""FP8 W8A8 (``sparrow.quant.fp8``): the quantize / dequantize references, the Linear method, loading FP8
checkpoints and quantizing float checkpoints at load, end to end on a tiny random Llama.

Budgets (NMSE = ||y - ref||^2 / ||ref||^2 against x @ dequant(W).T, the dequantized reference):
- R <= 16 rows (GEMV, activations not quantized): only fp32 summation order differs, NMSE <= 1e-10;
- R > 16 rows (W8A8 GEMM): e4m3 activations keep 3 mantissa bits (relative rms rounding ~2^-4 / sqrt(3)
  = 3.6 %, NMSE ~1.3e-3 for Gaussian inputs), budget NMSE <= 5e-3.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparrow.errors import InvalidRequestError, ModelLoadError
from sparrow.kernels import backend
from sparrow.kernels.gemm.gemv import FP8_MAX_ROWS, W8A8_MAX_ROWS
from sparrow.layers.linear import Linear
from sparrow.quant.unquantized import UnquantizedLinearMethod
from sparrow.quant import bind_quant_config, quant_config_scope
from sparrow.quant.fp8 import (
    Fp8Config,
    Fp8LinearMethod,
    dequantize_fp8_block,
    dequantize_fp8_channel,
    quantize_fp8_block,
    quantize_fp8_channel,
)
from tests.helpers import nmse

ROWS = [1, 2, 3, 16, 17, 33, 257]
GEMV_NMSE, GEMM_NMSE = 1e-10, 5e-3  # W8A16 (exact products) / W8A8 (activations quantized too)


def _budget(rows: int) -> float:
    """W8A8 up to W8A8_MAX_ROWS, W8A16 up to FP8_MAX_ROWS, W8A8 above (Fp8LinearMethod.apply)."""
    return GEMV_NMSE if W8A8_MAX_ROWS < rows <= FP8_MAX_ROWS else GEMM_NMSE


# ---- references ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1, 1), (128, 128), (130, 200), (257, 384), (300, 129)])
def test_block_round_trip_error_bound(n, k):
    """|w - dequant| <= 2^-4 |w| (3 mantissa bits) + 2^-10 * scale (subnormal step 2^-9, halved)."""
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]  # blocks of very different size
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert s.dtype == torch.float32 and s.shape == (-(-n // 128), -(-k // 128))
    full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    err = (dequantize_fp8_block(q, s) - w).abs()
    assert (err <= 2**-4 * w.abs() + 2**-10 * full + 1e-6 * w.abs()).all()
    assert nmse(dequantize_fp8_block(q, s), w) < 2e-3


def test_block_amax_maps_to_448_and_zero_block():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.randn(128, 128)
    q, s = quantize_fp8_block(w)
    assert q[:128, :128].float().abs().max() == 448  # each block's amax lands on e4m3's largest value
    assert (q[128:].float() == 0).all() and (s[1] > 0).all()  # an all-zero block: tiny scale, q = 0, no NaN
    exact = q.float() * 0.5  # representable values survive a second round trip exactly
    q2, s2 = quantize_fp8_block(dequantize_fp8_block(q, s))
    torch.testing.assert_close(dequantize_fp8_block(q2, s2), dequantize_fp8_block(q, s), atol=0, rtol=0)
    assert exact.isfinite().all()


def test_channel_round_trip_error_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 200, generator=g) * torch.logspace(-3, 1, 130)[:, None]
    q, s = quantize_fp8_channel(w)
    assert s.shape == (130, 1)
    err = (dequantize_fp8_channel(q, s) - w).abs()
    assert (err <= 2**-4 * w.abs() + 2**-10 * s + 1e-6 * w.abs()).all()
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8_channel(torch.ones(3, dtype=torch.int32))


# ---- the Linear method --------------------------------------------------------------------------------

def _fp8_linear(sizes, k, *, from_checkpoint: bool, seed=0, bias=False):
    """An FP8 Linear filled shard by shard from float weights (on-load) or their quantized pieces
    (checkpoint layout); returns (layer, float weight [N, K])."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(n, k, generator=g) * 0.05 * (i + 1) for i, n in enumerate(sizes)]
    layer = Linear(k, output_sizes=sizes, bias=bias, quant_method=Fp8LinearMethod(from_checkpoint))
    packed = len(sizes) > 1
    for i, w in enumerate(shards):
        sid = i if packed else None
        if from_checkpoint:
            q, s = quantize_fp8_block(w)
            layer.weight.weight_loader(layer.weight, q, sid, f"w{i}")
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, sid, f"s{i}")
        else:
            layer.weight.weight_loader(layer.weight, w, sid, f"w{i}")
    if bias:
        layer.bias.data.copy_(torch.randn(sum(sizes), generator=g))
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.cat(shards)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("sizes,k", [([256], 384), ([128, 256, 2], 200), ([130], 129)], ids=["even", "packed-odd", "odd"])
def test_apply_vs_dequantized_reference(rows, sizes, k):
    layer, _ = _fp8_linear(sizes, k, from_checkpoint=False, seed=rows, bias=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    ref = x @ layer.quant_method.dequantized_weight(layer).T + layer.bias
    y = layer(x)
    assert y.shape == (rows, sum(sizes)) and y.dtype == x.dtype
    assert nmse(y, ref) <= _budget(rows)


@pytest.mark.parametrize("rows", [1, 4, 17, 33])
def test_apply_triton_path_matches_torch_path(rows):
    """The Triton kernels (interpreter on CPU, fp32) against the torch path of the same layer: 2 x rows take the
    W8A8 GEMV up to W8A8_MAX_ROWS (16), the W8A16 GEMV up to FP8_MAX_ROWS (64), the W8A8 GEMM above."""
    layer, _ = _fp8_linear([128, 130], 200, from_checkpoint=False, seed=5)
    x = torch.randn(2, rows, 200, generator=torch.Generator().manual_seed(0))  # 3-D input
    ref = layer(x)
    with backend("triton"):
        y = layer(x)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 17, 33])
def test_apply_bf16(rows):
    layer, _ = _fp8_linear([256], 256, from_checkpoint=False)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    ref = x.float() @ layer.quant_method.dequantized_weight(layer).T
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert nmse(y, ref) <= (1e-4 if W8A8_MAX_ROWS < rows <= FP8_MAX_ROWS else GEMM_NMSE)


def test_checkpoint_layout_equals_on_load_quantization():
    """Aligned packed shards: quantizing each shard (an FP8 checkpoint) == quantizing the packed weight."""
    a, _ = _fp8_linear([256, 128, 128], 384, from_checkpoint=True, seed=3)
    b, _ = _fp8_linear([256, 128, 128], 384, from_checkpoint=False, seed=3)
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert torch.equal(a.weight_scale_inv, b.weight_scale_inv)


def test_unaligned_packed_shard_is_a_clear_error():
    layer = Linear(128, output_sizes=[64, 64], quant_method=Fp8LinearMethod(True))
    q, s = quantize_fp8_block(torch.randn(64, 128))
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, 0, "k_proj.weight_scale_inv")
    with pytest.raises(ModelLoadError, match=r"'v_proj.weight_scale_inv'.*starts at row 64.*128-row boundary"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, 1, "v_proj.weight_scale_inv")
    with pytest.raises(ModelLoadError, match="float8_e4m3fn"):
        layer.weight.weight_loader(layer.weight, torch.randn(64, 128), 0, "k_proj.weight")
    # on-load quantization stages the whole packed weight, so unaligned shards are fine there
    b, w = _fp8_linear([64, 64], 128, from_checkpoint=False)
    torch.testing.assert_close(b.quant_method.dequantized_weight(b), dequantize_fp8_block(*quantize_fp8_block(w)))


def test_quant_config_scope_and_bind():
    cfg = Fp8Config(from_checkpoint=True, ignored_layers=("layers.1.o_proj",))
    with quant_config_scope(cfg):
        model = torch.nn.ModuleDict({
            "gate": Linear(128, 8),  # a router-like name stays float
            "layers": torch.nn.ModuleList([torch.nn.ModuleDict({"o_proj": Linear(128, 128)}) for _ in range(2)]),
        })
    assert all(isinstance(m.quant_method, Fp8LinearMethod) for m in model.modules() if isinstance(m, Linear))
    bind_quant_config(model, cfg)
    assert model["layers"][0]["o_proj"].weight.dtype == torch.float8_e4m3fn
    assert model["layers"][0]["o_proj"].prefix == "layers.0.o_proj"
    for name in ("gate", "layers.1.o_proj"):
        m = model.get_submodule(name)
        assert isinstance(m.quant_method, UnquantizedLinearMethod) and m.weight.dtype == torch.float32
        assert not hasattr(m, "weight_scale_inv")
    assert Linear(8, 8).weight.dtype == torch.float32  # outside the scope: float


def test_config_from_hf():
    cfg = Fp8Config.from_hf({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                             "modules_to_not_convert": ["lm_head"]})
    assert cfg.from_checkpoint and cfg.ignored_layers == ("lm_head",)
    for qc, match in [({"quant_method": "gptq"}, "'gptq' is not supported"),
                      ({"quant_method": "fp8"}, "weight_block_size=None"),
                      ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"only \[128, 128\]"),
                      ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                       "'static'")]:
        with pytest.raises(ModelLoadError, match=match):
            Fp8Config.from_hf(qc)
    assert not cfg.quantizes("model.layers.0.mlp.gate") and cfg.quantizes("model.layers.0.mlp.gate_up_proj")
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    for qc, match in [("fp8", "must be an object"), (["fp8"], "must be an object"),
                      ({**fp8, "weight_block_size": 128}, "weight_block_size=128 is not supported"),
                      ({**fp8, "weight_block_size": ["a", "b"]}, r"weight_block_size=\['a', 'b'\]"),
                      ({**fp8, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
                      ({**fp8, "ignored_layers": [1]}, "ignored_layers must be a list")]:
        with pytest.raises(ModelLoadError, match=match):
            Fp8Config.from_hf(qc)


# ---- end to end: a tiny random Llama ------------------------------------------------------------------

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
_LINEAR_RE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("fp8") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(str(path), safe_serialization=True)
    return path


def write_fp8_checkpoint(src: Path, dst: Path, keep_float: tuple[str, ...] = (), not_convert=None) -> Path:
    """The DeepSeek / Qwen FP8 layout: each linear ``*.weight`` as e4m3 + ``*.weight_scale_inv`` [N/128, K/128];
    the modules named in ``keep_float`` (HF names) stay float, and config.json lists ``not_convert`` (default
    ``keep_float``) as ``modules_to_not_convert``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            module = name.rpartition(".")[0]
            if name.endswith(".weight") and name.split(".")[-2] in _LINEAR_RE and module not in keep_float:
                q, s = quantize_fp8_block(t)
                out[name], out[name + "_scale_inv"] = q, s
            else:
                out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    names = list(keep_float if not_convert is None else not_convert)
    if names:
        cfg["quantization_config"]["modules_to_not_convert"] = names
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _prompts(count=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in (3, 5, 9, 17, 30, 12)[:count]]


def greedy_agreement(ref_llm, test_llm, prompts, steps=24) -> tuple[float, float]:
    """(per-step agreement, free-running prefix fraction). Per step: the test model, fed the reference
    model's greedy continuation (teacher forcing, via prompt logprobs), picks the same argmax token. Free
    running: the fraction of steps before the two greedy generations first differ."""
    from sparrow import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    free = [o.outputs[0].token_ids for o in test_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    same = total = prefix = 0
    for p, r, f in zip(prompts, ref, free):
        out = test_llm.generate({"prompt_token_ids": p + list(r)}, forced)[0]
        plp = out.outputs[0].token_ids[:1]
        argmax = [next(t for t, lp in d.items() if lp.rank == 1) for d in out.prompt_logprobs[len(p):]] + plp
        same += sum(a == b for a, b in zip(argmax, r))
        total += len(r)
        k = 0
        while k < len(r) and r[k] == f[k]:
            k += 1
        prefix += k
    return same / total, prefix / total


def test_on_load_fp8_greedy_agreement(tiny_dir, capsys):
    from sparrow import LLM

    base = LLM(str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True)
    fp8 = LLM(str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True, quantization="fp8")
    assert fp8.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    per_step, prefix = greedy_agreement(base, fp8, _prompts())
    with capsys.disabled():
        print(f"\nFP8 on-load vs fp32 greedy: per-step agreement {per_step:.1%}, free-running prefix {prefix:.1%}")
    assert per_step >= 0.8


def test_fp8_checkpoint_matches_on_load_quantization(tiny_dir, tmp_path):
    from sparrow import LLM, SamplingParams
    from sparrow.loader.model_loader import load_model

    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    a = load_model(ckpt).model
    b = load_model(tiny_dir, quantization="fp8").model
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert p.dtype == pb[name].dtype, name
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           pb[name].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else pb[name]), name
    assert a.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert a.model.embed_tokens.weight.dtype == torch.float32

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    outs = [LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, **kw).generate(prompts, sp)
            for path, kw in ((ckpt, {}), (tiny_dir, {"quantization": "fp8"}))]
    for x, y in zip(*outs):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs  # same logits -> bit-identical logprobs
        assert x.prompt_logprobs == y.prompt_logprobs


def test_fp8_checkpoint_with_unaligned_packed_shards_fails_clearly(tmp_path):
    import transformers

    src = tmp_path / "src"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1})).save_pretrained(
        str(src), safe_serialization=True)  # k_proj / v_proj have 64 rows
    ckpt = write_fp8_checkpoint(src, tmp_path / "fp8")
    from sparrow.loader.model_loader import load_model

    with pytest.raises(ModelLoadError, match="128-row boundary"):
        load_model(ckpt)


def test_modules_to_not_convert_in_checkpoint_names(tiny_dir, tmp_path):
    """``modules_to_not_convert`` names HF modules: layer 0's q / k / v and gate / up (packed by sparrow into
    qkv_proj and gate_up_proj) stay float and load exactly as with sparrow's own names; listing only some
    projections of a packed layer is refused by name."""
    from sparrow.loader.model_loader import load_model

    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    keep = tuple(f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")) + (f"{mlp}.gate_proj", f"{mlp}.up_proj")
    hf_names = load_model(write_fp8_checkpoint(tiny_dir, tmp_path / "hf", keep)).model
    ours = load_model(write_fp8_checkpoint(tiny_dir, tmp_path / "ours", keep,
                                           not_convert=(f"{attn}.qkv_proj", f"{mlp}.gate_up_proj"))).model
    layer0, layer1 = hf_names.model.layers
    assert layer0.self_attn.qkv_proj.weight.dtype == layer0.mlp.gate_up_proj.weight.dtype == torch.float32
    assert layer0.self_attn.o_proj.weight.dtype == layer1.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    theirs = dict(ours.named_parameters())
    for name, p in hf_names.named_parameters():
        same = torch.equal(p.view(torch.uint8), theirs[name].view(torch.uint8)) if p.dtype == torch.float8_e4m3fn \
            else torch.equal(p, theirs[name])
        assert same, name
    with pytest.raises(ModelLoadError, match=r"\['model.layers.0.self_attn.q_proj'\] unquantized .* 'model.layers.0"
                                             r".self_attn.qkv_proj'; a packed layer must be all FP8 or all float"):
        load_model(write_fp8_checkpoint(tiny_dir, tmp_path / "partial", (f"{attn}.q_proj",)))


def test_missing_packed_scale_names_its_shape(tiny_dir, tmp_path):
    """A missing scale of a packed projection is named with its own [ceil(rows / 128), K / 128] shape."""
    from safetensors.torch import load_file, save_file

    from sparrow.loader.model_loader import load_model

    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]  # up_proj: 512 rows, K = 256
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.up_proj.weight_scale_inv', expected shape \(4, 2\)"):
        load_model(ckpt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_block_scale_is_refused_by_name(tiny_dir, tmp_path, bad):
    """A NaN or inf in an FP8 checkpoint's block scales (a corrupt file) is a ModelLoadError naming the tensor,
    not a model whose outputs turn NaN."""
    from safetensors.torch import load_file, save_file

    from sparrow.loader.model_loader import load_model

    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"][0, 1] = bad
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.self_attn.o_proj.weight_scale_inv' \(FP8 block "
                                             r"scales\) holds non-finite values"):
        load_model(ckpt)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_e4m3_weight_byte_is_refused_by_name(tiny_dir, tmp_path, byte):
    """An e4m3 weight byte that encodes NaN (S.1111.111; the OCP FP8 spec's e4m3fn has no inf, and no quantizer
    writes NaN) is a ModelLoadError naming the tensor, not a layer whose outputs turn NaN."""
    from safetensors.torch import load_file, save_file

    from sparrow.loader.model_loader import load_model

    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"].view(torch.uint8)[3, 7] = byte
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.down_proj.weight' \(float8_e4m3fn\) holds NaN "
                                             r"bytes"):
        load_model(ckpt)


def test_fp8_tensors_outside_an_fp8_model_are_named(tiny_dir, tmp_path):
    """An FP8 checkpoint without its quantization_config (scales unused), and an e4m3 tensor for a float
    parameter (the embedding), are refused by name instead of being dropped or cast."""
    from safetensors.torch import load_file, save_file

    from sparrow.loader.model_loader import load_model

    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "no_config")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"is an FP8 block scale, but LlamaForCausalLM has no FP8 parameter"):
        load_model(ckpt)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    (tmp_path / "e4m3_embed").mkdir()
    save_file(tensors, str(tmp_path / "e4m3_embed" / "model.safetensors"))
    (tmp_path / "e4m3_embed" / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"'model.embed_tokens.weight' is torch.float8_e4m3fn, but "
                                             r"'model.embed_tokens.weight' is torch.float32"):
        load_model(tmp_path / "e4m3_embed")


def test_unsupported_quantization_names_itself(tiny_dir):
    from sparrow import LLM

    with pytest.raises(InvalidRequestError, match=r"quantization='int3' is not supported \(supported: None, 'fp8', "):
        LLM(str(tiny_dir), device="cpu", skip_tokenizer_init=True, quantization="int3")
    from sparrow.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--quantization", "fp8"])
    assert args.quantization == "fp8"


def test_fp8_lm_head_logits_and_greedy_agreement(tiny_dir, capsys):
    """``quantize_lm_head``: the logits come from the block quantization of the LM weight (the numbers of the
    other FP8 linears: NMSE budget by rows against x @ dequant(W).T), and greedy decoding mostly agrees with
    the FP8 model whose LM head stays fp32."""
    from sparrow import LLM

    fp8 = LLM(str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True, quantization="fp8")
    head = LLM(str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True, quantization="fp8",
               quantize_lm_head=True)
    model = head.engine.runner.model
    assert getattr(fp8.engine.runner.model, "lm_head_quantized", None) is None
    assert not hasattr(model, "lm_head")  # untied (LlamaConfig's default): the fp32 LM head is dropped
    q, s = quantize_fp8_block(fp8.engine.runner.model.lm_weight.float())
    assert torch.equal(model.lm_head_quantized.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(model.lm_head_quantized.weight_scale_inv, s)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 17, 33, 80):
        h = torch.randn(rows, TINY["hidden_size"], generator=g)
        logits = model.compute_logits(h)
        assert logits.dtype == torch.float32 and logits.shape == (rows, TINY["vocab_size"])
        assert nmse(logits, h @ dequantize_fp8_block(q, s).T) <= _budget(rows), rows
    per_step, prefix = greedy_agreement(fp8, head, _prompts())
    with capsys.disabled():
        print(f"\nFP8 LM head vs fp32 LM head (FP8 linears both): per-step agreement {per_step:.1%}, "
              f"free-running prefix {prefix:.1%}")
    assert per_step >= 0.8


def test_fp8_lm_head_needs_fp8_linears(tiny_dir):
    from sparrow import LLM
    from sparrow.cli import build_parser

    with pytest.raises(InvalidRequestError, match="quantize_lm_head needs FP8 linear layers"):
        LLM(str(tiny_dir), device="cpu", skip_tokenizer_init=True, quantize_lm_head=True)
    args = build_parser().parse_args(["generate", "hi", "--quantization", "fp8", "--quantize-lm-head"])
    assert args.quantize_lm_head and args.quantization == "fp8"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 17, 64, 200])
def test_gpu_fp8_lm_head_shape(rows):
    """An FP8 Linear at Gemma 4's LM head (V 262,144 x H 2,816), bf16 activations, as ``quantize_lm_head`` builds
    it: the W8A8 GEMV (4,096 tiles, no split-K) up to 16 rows, then cuBLAS's block-scaled GEMM where the device
    has it (a weight this wide takes it from 17 rows), else the W8A16 GEMV / Triton GEMM; against x @ dequant(W).T
    (W8A8 budget; the W8A16 GEMV's products are exact)."""
    from sparrow.kernels.gemm.scaled_mm import scaled_mm_supported
    from sparrow.quant.fp8 import scaled_mm_min_rows

    v, h = 262144, 2816
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(v, h, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    with torch.device("cuda"):
        layer = Linear(h, v, dtype=torch.bfloat16, quant_method=Fp8LinearMethod(from_checkpoint=False))
    layer.weight.weight_loader(layer.weight, w, None, "lm_head.weight")
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(rows, h, generator=g, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ layer.quant_method.dequantized_weight(layer).T
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, v)
    cublas = scaled_mm_supported(x.device) and rows >= scaled_mm_min_rows(layer)
    w8a16 = W8A8_MAX_ROWS < rows <= FP8_MAX_ROWS and not cublas
    assert nmse(y, ref) <= (1e-4 if w8a16 else GEMM_NMSE), (rows, cublas)
