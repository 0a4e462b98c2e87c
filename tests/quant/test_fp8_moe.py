"""On-load FP8 of the routed experts (FusedMoE): a float Qwen3-MoE checkpoint loaded with
``quantization="fp8"`` gets e4m3 expert weights with 128 x 128 block scales; the layer equals the torch
twin ``fused_moe_fp8_ref`` on those weights; greedy decoding mostly agrees with the unquantized model; the
Triton path (interpreter on CPU) matches the torch path; layers whose widths are not multiples of 128 stay
in the model dtype."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.fp8 import dequantize_fp8_block_ref
from sparrow.kernels.moe.moe import fused_moe_fp8_ref
from sparrow.layers.moe import FusedMoE
from sparrow.quant.fp8_moe import Fp8MoEMethod, quantize_experts
from tests.helpers import make_llm
from tests.quant.test_fp8 import greedy_agreement

VOCAB = 256
TINY_MOE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, max_position_embeddings=256, norm_topk_prob=True, initializer_range=0.05)
TRITON_ATOL = 2e-3
"""Triton (interpreter) vs torch twin of the FP8 experts, fp32 activations: both dequantize the same e4m3
weights and quantize activations per 128 group the same way; they differ only in accumulation order (and
the rare activation rounding to a neighbouring e4m3 value that this can cause)."""


def _save_qwen3_moe(path: Path, **overrides) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return _save_qwen3_moe(tmp_path_factory.mktemp("fp8_moe") / "qwen3_moe")


@pytest.fixture(scope="module")
def llms(moe_dir):
    return make_llm(moe_dir, max_model_len=128), make_llm(moe_dir, max_model_len=128, quantization="fp8")


def _experts(llm) -> list[tuple[str, FusedMoE]]:
    return [(n, m) for n, m in llm.engine.runner.model.named_modules() if isinstance(m, FusedMoE)]


def _routing(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, TINY_MOE["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(TINY_MOE["num_experts"], generator=g)[:2] for _ in range(rows)])
    w = torch.softmax(torch.randn(rows, 2, generator=g), dim=-1)
    return x, w, ids


def test_expert_params_are_fp8_with_block_scales(llms):
    base, fp8 = llms
    layers = _experts(fp8)
    assert len(layers) == TINY_MOE["num_hidden_layers"]
    e, h, i = TINY_MOE["num_experts"], TINY_MOE["hidden_size"], TINY_MOE["moe_intermediate_size"]
    ref = dict(_experts(base))
    for name, m in layers:
        assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.float8_e4m3fn
        assert tuple(m.gate_up_proj.shape) == (e, 2 * i, h) and tuple(m.down_proj.shape) == (e, h, i)
        assert m.w13_scale.dtype == m.w2_scale.dtype == torch.float32
        assert tuple(m.w13_scale.shape) == (e, 2 * i // 128, h // 128)
        assert tuple(m.w2_scale.shape) == (e, h // 128, i // 128)
        # the dequantized experts are the float ones up to e4m3 rounding (3 mantissa bits: <= 2^-4 relative)
        for q, s, w in ((m.gate_up_proj, m.w13_scale, ref[name].gate_up_proj),
                        (m.down_proj, m.w2_scale, ref[name].down_proj)):
            for k in range(e):
                dq = dequantize_fp8_block_ref(q[k], s[k])
                assert torch.all((dq - w[k]).abs() <= w[k].abs() * 2 ** -4 + s[k].max() * 2 ** -9), name
    assert all(getattr(m, "w13_scale", None) is None and m.gate_up_proj.dtype == torch.float32 for _, m in _experts(base))
    # the shared-nothing parts stay as the dense FP8 path left them: router float, attention e4m3
    layer0 = fp8.engine.runner.model.model.layers[0]
    assert layer0.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer0.mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("rows", [3, 40])  # per-pair sized and grouped sized
def test_layer_equals_fp8_reference(llms, rows):
    _, fp8 = llms
    x, w, ids = _routing(rows)
    for _, m in _experts(fp8):
        want = fused_moe_fp8_ref(x, m.gate_up_proj, m.down_proj, w, ids, m.activation, m.swiglu_limit,
                                 w13_scale=m.w13_scale, w2_scale=m.w2_scale)
        assert torch.equal(m(x, w, ids), want)


@pytest.mark.parametrize("rows", [3, 40])  # the Triton small (per-expert GEMV) and grouped GEMM paths
def test_triton_layer_matches_torch_path(llms, rows):
    _, fp8 = llms
    x, w, ids = _routing(rows, seed=1)
    for _, m in _experts(fp8):
        torch_out = m(x, w, ids)
        with backend("triton"):
            triton_out = m(x, w, ids)
        assert triton_out.dtype == torch_out.dtype
        torch.testing.assert_close(triton_out, torch_out, atol=TRITON_ATOL, rtol=0)


def test_greedy_agreement_with_unquantized(moe_dir, llms, capsys):
    """Teacher-forced per-step greedy agreement with the fp32 model: the whole FP8 model (attention, dense
    and expert linears), and the experts alone (quantize_experts on an otherwise fp32 model)."""
    base, fp8 = llms
    experts_only = make_llm(moe_dir, max_model_len=128)
    for name, m in _experts(experts_only):
        quantize_experts(m)
        assert isinstance(m.quant_method, Fp8MoEMethod)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 5, 9, 17, 30, 12)]
    per_step, prefix = greedy_agreement(base, fp8, prompts, steps=24)
    per_step_e, prefix_e = greedy_agreement(base, experts_only, prompts, steps=24)
    with capsys.disabled():
        print(f"\nFP8 on-load (experts included) vs fp32 greedy: per-step agreement {per_step:.1%}, free-running "
              f"prefix {prefix:.1%}; experts alone FP8: {per_step_e:.1%}, prefix {prefix_e:.1%}")
    assert per_step >= 0.7
    assert per_step_e >= 0.7


def test_triton_path_end_to_end_matches_torch_path(moe_dir, llms):
    from sparrow import SamplingParams

    _, fp8 = llms
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (6, 21)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    want = fp8.generate(prompts, sp)
    with backend("triton"):
        got = make_llm(moe_dir, max_model_len=64, quantization="fp8").generate(prompts, sp)
    for a, b in zip(got, want):
        # the first token comes from identical inputs; later ones may follow a near-tie either way
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        ta, tb = a.outputs[0].token_ids[0], b.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][ta].logprob - b.outputs[0].logprobs[0][tb].logprob) < 1e-2


def test_unaligned_expert_width_quantizes_with_partial_blocks(tmp_path):
    """I = 96 (Gemma 4 26B-A4B has 704): the packed gate|up weight [2I, H] gets ceil(2I/128) scale rows, one
    of them spanning gate and up rows, the down weight a partial K block; the layer equals the FP8 twin, the
    Triton path (interpreter) matches it, and the dequantized weights are the float ones up to e4m3 rounding."""
    from sparrow import SamplingParams

    path = _save_qwen3_moe(tmp_path / "qwen3_moe_96", moe_intermediate_size=96)
    base, llm = make_llm(path, max_model_len=64), make_llm(path, max_model_len=64, quantization="fp8")
    ref = dict(_experts(base))
    e = TINY_MOE["num_experts"]
    x, w, ids = _routing(5, seed=3)
    for name, m in _experts(llm):
        assert isinstance(m.quant_method, Fp8MoEMethod) and m.gate_up_proj.dtype == torch.float8_e4m3fn
        assert tuple(m.w13_scale.shape) == (e, 2, 1) and tuple(m.w2_scale.shape) == (e, 1, 1)
        for k in range(e):
            dq = dequantize_fp8_block_ref(m.gate_up_proj[k], m.w13_scale[k])
            wf = ref[name].gate_up_proj[k]
            assert torch.all((dq - wf).abs() <= wf.abs() * 2 ** -4 + m.w13_scale[k].max() * 2 ** -9), name
        want = fused_moe_fp8_ref(x, m.gate_up_proj, m.down_proj, w, ids, m.activation, m.swiglu_limit,
                                 w13_scale=m.w13_scale, w2_scale=m.w2_scale)
        assert torch.equal(m(x, w, ids), want)
        with backend("triton"):
            torch.testing.assert_close(m(x, w, ids), want, atol=TRITON_ATOL, rtol=0)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def _fuse_experts(ckpt: Path) -> None:
    """Rewrite per-expert FP8 tensors as transformers 5's fused ones: ``experts.gate_up_proj`` [E, 2I, H]
    e4m3 + ``experts.gate_up_proj_scale_inv`` [E, 2I/128, H/128], ``experts.down_proj`` (+ scale)."""
    import re

    from safetensors.torch import load_file, save_file

    f = ckpt / "model.safetensors"
    tensors, per = load_file(str(f)), {}
    for name in list(tensors):
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$", name)
        if m:
            per.setdefault((m.group(1), m.group(4)), {})[(int(m.group(2)), m.group(3))] = tensors.pop(name)
    for (prefix, kind), parts in per.items():
        n = 1 + max(e for e, _ in parts)
        suffix = "" if kind == "weight" else "_scale_inv"
        tensors[f"{prefix}.gate_up_proj{suffix}"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
        tensors[f"{prefix}.down_proj{suffix}"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    save_file(tensors, str(f))


@pytest.fixture(scope="module")
def aligned_dir(tmp_path_factory) -> Path:
    """Head dim 64: q / k / v are 256 / 128 / 128 rows, so each checkpoint shard has whole scale blocks."""
    return _save_qwen3_moe(tmp_path_factory.mktemp("fp8_moe_aligned") / "qwen3_moe", head_dim=64)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_fp8_checkpoint_equals_on_load_quantization(aligned_dir, tmp_path, layout):
    """An FP8 checkpoint (e4m3 weights + 128 x 128 ``weight_scale_inv``, experts included) written by the test
    loads into the same parameters as on-load quantization of the float checkpoint, bit for bit, and
    generates the same tokens and logprobs."""
    from sparrow import SamplingParams
    from tests.quant.test_fp8 import write_fp8_checkpoint

    on_load = make_llm(aligned_dir, max_model_len=128, quantization="fp8")
    ckpt = write_fp8_checkpoint(aligned_dir, tmp_path / f"fp8_{layout}")
    if layout == "fused":
        _fuse_experts(ckpt)
    loaded = make_llm(ckpt, max_model_len=128)
    got = dict(loaded.engine.runner.model.named_parameters())
    want = dict(on_load.engine.runner.model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.dtype == want[name].dtype, name
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           want[name].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else want[name]), name
    assert all(isinstance(m.quant_method, Fp8MoEMethod) for _, m in _experts(loaded))
    prompts = [{"prompt_token_ids": [5, 9, 17, 33]}, {"prompt_token_ids": list(range(3, 40))}]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    for a, b in zip(loaded.generate(prompts, sp), on_load.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]


def test_fp8_checkpoint_with_float_experts_is_a_clear_error(aligned_dir, tmp_path, monkeypatch):
    """A checkpoint that declares FP8 but keeps the experts in float names the tensor and the dtypes."""
    import tests.quant.test_fp8 as t
    from sparrow.errors import ModelLoadError

    monkeypatch.setattr(t, "_LINEAR_RE", tuple(n for n in t._LINEAR_RE if n not in ("gate_proj", "up_proj", "down_proj")))
    ckpt = t.write_fp8_checkpoint(aligned_dir, tmp_path / "fp8_float_experts")
    with pytest.raises(ModelLoadError, match=r"experts\.0\.\w+_proj\.weight.*float32.*float8_e4m3fn"):
        make_llm(ckpt, max_model_len=64)


def test_mixtral_float_experts_named_as_hf_names_them(tmp_path, monkeypatch):
    """An FP8 Mixtral checkpoint whose experts stay float, listed in ``modules_to_not_convert`` under the
    checkpoint's own name (``block_sparse_moe.experts``; sparrow's module is ``mlp.experts``): the experts load
    as float and the attention as FP8; without the list the float experts are refused by name."""
    import transformers

    import tests.quant.test_fp8 as t
    from sparrow import SamplingParams
    from sparrow.errors import ModelLoadError

    src = tmp_path / "mixtral"
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_local_experts=4,
                                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, head_dim=64, max_position_embeddings=128)
    transformers.MixtralForCausalLM(cfg).save_pretrained(str(src), safe_serialization=True)
    experts = [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
    with pytest.raises(ModelLoadError, match=r"experts\.0\.w1\.weight.*float32.*float8_e4m3fn"):
        make_llm(t.write_fp8_checkpoint(src, tmp_path / "no_list"), max_model_len=64)
    llm = make_llm(t.write_fp8_checkpoint(src, tmp_path / "listed", not_convert=experts), max_model_len=64)
    model = llm.engine.runner.model
    assert all(not isinstance(m.quant_method, Fp8MoEMethod) and m.gate_up_proj.dtype == torch.float32 for _, m in _experts(llm))
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    # FP8 experts too, one scale missing: named as the checkpoint names it (block_sparse_moe, w3)
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(t, "_LINEAR_RE", t._LINEAR_RE + ("w1", "w2", "w3"))
    ckpt = t.write_fp8_checkpoint(src, tmp_path / "fp8_experts")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight_scale_inv"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks the tensor 'model.layers.0.block_sparse_moe.experts.2.w3."
                                             r"weight_scale_inv' \(or the fused 'model.layers.0.block_sparse_moe."
                                             r"experts.gate_up_proj_scale_inv'"):
        make_llm(ckpt, max_model_len=64)
