"""The weight-format registry (``sparrow.quant.registry``): a stand-in format defined in this file alone --
int8 weight-only, one fp32 scale per output row (``weight`` int8 [N, K] + ``weight_scale`` [N, 1]; experts
``experts.N.gate_proj.weight`` + ``.weight_scale``, fused ``experts.gate_up_proj`` + ``_scale``) -- registers
itself, and sparrow loads a tiny random Qwen3-MoE checkpoint in it (dense linears, routed experts, and the LM
head with ``quantize_lm_head``) with no edit elsewhere.

Oracle: the same checkpoint with every int8 tensor dequantized by the format's own torch reference
(``dequantize``: q * scale), loaded unquantized. The int8 methods compute with exactly those dequantized
weights, so prompt logprobs agree to fp32 summation order (LOGPROB_ATOL).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparrow.errors import InvalidRequestError, ModelLoadError
from sparrow.quant import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    register_quantization,
    supported_quantization,
)
from sparrow.layers.logits import QuantizedLMHeadMethod
from sparrow.quant.registry import unregister_quantization
from tests.helpers import make_llm
from tests.models._hf_tiny import FAMILIES, build, prompts

NAME = "int8_test"
LOGPROB_ATOL = 1e-5
"""Both sides multiply the same fp32 weights; only the order of fp32 sums may differ (F.linear vs bmm)."""


# ---- the stand-in format ------------------------------------------------------------------------------

def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (q int8 [..., N, K], scale fp32 [..., N, 1]): scale = max(amax(|row|), 1e-10) / 127,
    q = round(w / scale) (symmetric per-row int8)."""
    scale = w.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 127
    return torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch reference: q [..., N, K] int8, scale [..., N, 1] -> fp32 q * scale."""
    return q.float() * scale


class Int8LinearMethod(LinearMethodBase):
    def __init__(self, from_checkpoint: bool):
        self.from_checkpoint = from_checkpoint

    def create_weights(self, layer, dtype):
        n, k = layer.out_features, layer.in_features
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n, 1), requires_grad=False)
        if not self.from_checkpoint:  # rows quantize independently: each shard straight into place
            layer.weight.weight_loader = self._quantizing_loader(layer)
            layer.weight_scale.expected_shards = []

    @staticmethod
    def _quantizing_loader(layer):
        def load(param, loaded, shard_id, name):
            start = 0 if shard_id is None else sum(layer.output_sizes[:shard_id])
            q, s = quantize(loaded)
            layer.weight.data.narrow(0, start, q.shape[0]).copy_(q)
            layer.weight_scale.data.narrow(0, start, q.shape[0]).copy_(s)
        return load

    def apply(self, layer, x):
        return F.linear(x, dequantize(layer.weight, layer.weight_scale).to(x.dtype), layer.bias)


class Int8MoEMethod(FusedMoEMethodBase):
    checkpoint_tensors = FusedMoEMethodBase.checkpoint_tensors + (
        ("weight_scale", "_scale", "gate_up_proj", "w13_weight_scale"),
        ("weight_scale", "_scale", "down_proj", "w2_weight_scale"))

    def __init__(self, from_checkpoint: bool):
        self.from_checkpoint = from_checkpoint

    def create_weights(self, layer, dtype):
        from sparrow.quant.unquantized import stacked_expert_param

        h, i = layer.hidden_size, layer.intermediate_size
        wdt = torch.int8 if self.from_checkpoint else dtype
        layer.gate_up_proj = stacked_expert_param(layer, 2 * i, h, 2, wdt)
        layer.down_proj = stacked_expert_param(layer, h, i, 1, wdt)
        if self.from_checkpoint:
            layer.w13_weight_scale = stacked_expert_param(layer, 2 * i, 1, 2, torch.float32)
            layer.w2_weight_scale = stacked_expert_param(layer, h, 1, 1, torch.float32)

    def process_weights_after_loading(self, layer):
        if self.from_checkpoint:
            return
        for pname, sname in (("gate_up_proj", "w13_weight_scale"), ("down_proj", "w2_weight_scale")):
            q, s = quantize(getattr(layer, pname).data)
            setattr(layer, pname, nn.Parameter(q, requires_grad=False))
            setattr(layer, sname, nn.Parameter(s, requires_grad=False))

    def apply(self, layer, x, topk_weights, topk_ids, reduce=True):
        from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref

        return fused_moe_grouped_ref(x, dequantize(layer.gate_up_proj, layer.w13_weight_scale).to(x.dtype),
                                     dequantize(layer.down_proj, layer.w2_weight_scale).to(x.dtype), topk_weights,
                                     topk_ids, layer.activation, layer.swiglu_limit, reduce=reduce)


class Int8TestConfig(QuantizationConfig):
    name, title = NAME, "INT8-TEST"
    help = f"{NAME}: a test's int8 weight-only format"
    checkpoint_tensor_kinds = {"weight_scale": "an int8 row scale"}
    _ALWAYS_FLOAT = ("gate", "router", "shared_expert_gate")

    def __init__(self, from_checkpoint: bool):
        self.from_checkpoint = from_checkpoint

    @classmethod
    def from_hf(cls, qc):
        return cls(from_checkpoint=True)

    @classmethod
    def for_quantization(cls):
        return cls(from_checkpoint=False)

    def get_linear_method(self, prefix):
        if prefix is not None and prefix.rpartition(".")[2] in self._ALWAYS_FLOAT:
            from sparrow.quant.unquantized import UnquantizedLinearMethod

            return UnquantizedLinearMethod()
        return Int8LinearMethod(self.from_checkpoint)

    def get_moe_method(self, prefix):
        return Int8MoEMethod(self.from_checkpoint)

    def get_lm_head_linear_method(self):
        return Int8LinearMethod(from_checkpoint=False)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_quantization(Int8TestConfig)
    yield
    unregister_quantization(NAME)


# ---- checkpoints ----------------------------------------------------------------------------------------

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _rewrite(src: Path, dst: Path, edit, quant_method: str | None) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file(edit(tensors), str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quant_method is not None:
        cfg["quantization_config"] = {"quant_method": quant_method}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _quantized(name: str) -> bool:
    parts = name.split(".")
    per_linear = parts[-1] == "weight" and parts[-2] in _LINEARS and ".mlp.gate." not in name
    fused = ".experts." in name and parts[-1] in ("gate_up_proj", "down_proj")
    return per_linear or fused


def write_int8_checkpoint(src: Path, dst: Path) -> Path:
    def edit(tensors):
        out = {}
        for name, t in tensors.items():
            if _quantized(name):
                out[name], out[name + "_scale"] = quantize(t)
            else:
                out[name] = t
        return out

    return _rewrite(src, dst, edit, NAME)


def write_dequantized(src: Path, dst: Path, lm_head_too: bool = False) -> Path:
    """The oracle checkpoint: every int8 tensor of ``src`` replaced by ``dequantize(q, scale)`` (float, same
    name); with ``lm_head_too`` also the LM weight rounded through the format (what ``quantize_lm_head`` uses)."""
    def edit(tensors):
        out = {}
        for name, t in tensors.items():
            if name.endswith("_scale"):
                continue
            out[name] = dequantize(t, tensors[name + "_scale"]) if t.dtype == torch.int8 else t
        if lm_head_too:
            out["lm_head.weight"] = dequantize(*quantize(out["lm_head.weight"]))
        return out

    return _rewrite(src, dst, edit, None)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("int8") / "qwen3_moe"
    build(FAMILIES, "qwen3_moe", path, tie_word_embeddings=False)
    return path


@pytest.fixture(scope="module")
def int8_dir(float_dir, tmp_path_factory) -> Path:
    return write_int8_checkpoint(float_dir, tmp_path_factory.mktemp("int8") / "ckpt")


def _prompt_logprobs(llm) -> list[dict[int, float]]:
    from sparrow import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp)
    return [{t: lp.logprob for t, lp in d.items()} for o in outs for d in o.prompt_logprobs if d]


def _assert_close(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        for tok, lp in w.items():  # the oracle's top-5 tokens are in ours, at the same logprob
            assert tok in g and abs(g[tok] - lp) <= LOGPROB_ATOL, (tok, g, w)


# ---- tests --------------------------------------------------------------------------------------------

def test_registered_everywhere():
    """The registry's names reach the CLI choices and the error of an unknown ``quantization=``."""
    from sparrow.cli import build_parser

    assert NAME in supported_quantization() and "fp8" in supported_quantization()
    assert build_parser().parse_args(["generate", "hi", "--quantization", NAME]).quantization == NAME
    assert build_parser().parse_args(["generate", "hi", "--quantization", "GPTQ"]).quantization == "gptq"
    with pytest.raises(InvalidRequestError, match=rf"quantization='int3' is not supported \(supported: None, .*"
                                                  rf"'{NAME}'"):
        make_llm("/nonexistent", quantization="int3")


def test_int8_checkpoint_logits_equal_dequantized_oracle(int8_dir, tmp_path):
    llm = make_llm(int8_dir, max_model_len=64)
    model = llm.engine.runner.model
    layer0 = model.model.layers[0]
    assert layer0.self_attn.qkv_proj.weight.dtype == torch.int8
    assert isinstance(layer0.mlp.experts.quant_method, Int8MoEMethod)
    assert layer0.mlp.experts.gate_up_proj.dtype == torch.int8
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.int8  # mlp_only_layers=[1]: dense MLP
    assert layer0.mlp.gate.weight.dtype == torch.float32  # the router stays float
    oracle = make_llm(write_dequantized(int8_dir, tmp_path / "dequantized"), max_model_len=64)
    _assert_close(_prompt_logprobs(llm), _prompt_logprobs(oracle))


def test_on_load_quantization_equals_the_checkpoint(float_dir, int8_dir):
    """``quantization="int8_test"`` on the float checkpoint gives the parameters of the int8 checkpoint."""
    got = dict(make_llm(float_dir, max_model_len=64, quantization=NAME).engine.runner.model.named_parameters())
    want = dict(make_llm(int8_dir, max_model_len=64).engine.runner.model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name


def test_quantized_lm_head_equals_oracle(int8_dir, tmp_path):
    llm = make_llm(int8_dir, max_model_len=64, quantize_lm_head=True)
    assert llm.engine.runner.model.lm_head_quantized.weight.dtype == torch.int8
    oracle = make_llm(write_dequantized(int8_dir, tmp_path / "dequantized_head", lm_head_too=True), max_model_len=64)
    _assert_close(_prompt_logprobs(llm), _prompt_logprobs(oracle))


def test_unknown_quant_method_and_stray_scale_are_named(int8_dir, float_dir, tmp_path):
    bad = _rewrite(float_dir, tmp_path / "int3", lambda t: t, "int3_test")
    with pytest.raises(ModelLoadError, match=rf"quant_method='int3_test' is not supported \(supported: .*{NAME}"):
        make_llm(bad)
    no_config = _rewrite(int8_dir, tmp_path / "no_config", lambda t: t, None)
    with pytest.raises(ModelLoadError, match=r"is an int8 row scale, but Qwen3MoeForCausalLM has no INT8-TEST "
                                             r"parameter|is torch.int8, but .* is torch.float32"):
        make_llm(no_config)


def test_quantization_other_than_the_checkpoints_format_is_refused(int8_dir):
    """``quantization=`` naming another format than the checkpoint's quantization_config is an error naming both
    (as vLLM's); naming the checkpoint's own format loads it as without."""
    with pytest.raises(InvalidRequestError, match=rf"quantization='fp8' .* checkpoint .*'{NAME}'"):
        make_llm(int8_dir, max_model_len=64, quantization="fp8")
    model = make_llm(int8_dir, max_model_len=64, quantization=NAME).engine.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
