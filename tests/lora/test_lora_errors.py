"""What LoRA refuses, with a LoRAAdapterError (an InvalidRequestError) or InvalidRequestError naming the problem:
DoRA, aLoRA, a rank over max_lora_rank, a target sparrow cannot adapt or that the model lacks, a missing folder, a
lora_request without enable_lora, a bad lora_int_id, a lora_request list of the wrong length, a malformed
adapter_config.json, factors that are not finite floating-point tensors or have rank 0, an adapter_model.bin
that holds objects other than tensors or is not a state dict, a folder without weights. Adapters made with PEFT on a
tiny random Llama."""
from __future__ import annotations

import datetime

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow import LoRARequest, SamplingParams
from sparrow.errors import InvalidRequestError, LoRAAdapterError
from tests.helpers import assert_one_line, make_llm
from tests.lora._adapters import base_model, make_adapter

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
PARAMS = SamplingParams(max_tokens=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_model("llama", tmp_path_factory.mktemp("lora-errors") / "base")


@pytest.fixture(scope="module")
def llm(base):
    return make_llm(base, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=4)


def _refused(llm, path, match, cls=LoRAAdapterError):
    with pytest.raises(cls, match=match) as err:
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("bad", 7, str(path)))
    assert_one_line(str(err.value))
    assert not llm.engine.requests  # nothing left queued


def test_dora(llm, base, tmp_path):
    _refused(llm, make_adapter("llama", base, tmp_path / "dora", 0, r=4, target_modules=["q_proj"], use_dora=True),
             "DoRA")


def test_activated_lora(llm, base, tmp_path):
    """aLoRA (PEFT ``alora_invocation_tokens``) applies the adapter only from its invocation tokens on; run as a
    plain LoRA its output would differ from PEFT's, so it is refused."""
    path = make_adapter("llama", base, tmp_path / "alora", 0, r=4, target_modules=["q_proj"],
                        alora_invocation_tokens=[10, 11], task_type="CAUSAL_LM")
    _refused(llm, path, r"aLoRA \(alora_invocation_tokens=\[10, 11\]\) is not supported")


def test_rank_over_max_lora_rank(llm, base, tmp_path):
    path = make_adapter("llama", base, tmp_path / "r8", 0, r=8, target_modules=["v_proj"])
    _refused(llm, path, r"rank 8 of '.*v_proj' exceeds max_lora_rank=4")


def test_target_that_cannot_be_adapted(llm, base, tmp_path):
    _refused(llm, make_adapter("llama", base, tmp_path / "head", 0, r=4, target_modules=["lm_head"]),
             "'lm_head' is a VocabEmbedding, which LoRA cannot adapt")


def test_target_the_model_lacks(llm, base, tmp_path):
    path = make_adapter("llama", base, tmp_path / "x", 0, r=4, target_modules=["q_proj"])
    file = path / "adapter_model.safetensors"
    save_file({k.replace("q_proj", "x_proj"): v for k, v in load_file(str(file)).items()}, str(file))
    _refused(llm, path, "'model.layers.0.self_attn.x_proj' does not exist in the model")


def test_missing_folder(llm, tmp_path):
    _refused(llm, tmp_path / "nowhere", "is not a folder")


def test_lora_request_without_enable_lora(base):
    plain = make_llm(base, max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"enable_lora=True"):
        plain.generate(PROMPT, PARAMS, lora_request=LoRARequest("a", 1, str(base)))


def test_bad_requests(llm, base):
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an int >= 1"):
        LoRARequest("a", 0, str(base))
    with pytest.raises(InvalidRequestError, match="got 2 lora_requests for 1 prompts"):
        llm.generate(PROMPT, PARAMS, lora_request=[None, None])
    with pytest.raises(InvalidRequestError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPT, PARAMS, lora_request="adapter")
    with pytest.raises(InvalidRequestError, match="max_loras=0 must be at least 1"):
        make_llm(base, enable_lora=True, max_loras=0)


def _edited_config(base, tmp_path, name, edit):
    import json

    path = make_adapter("llama", base, tmp_path / name, 0, r=4, target_modules=["q_proj"])
    file = path / "adapter_config.json"
    cfg = json.loads(file.read_text())
    file.write_text(json.dumps(edit(cfg)))
    return path


@pytest.mark.parametrize("edit, match", [
    (lambda cfg: [cfg], "holds a JSON list, not an object"),
    (lambda cfg: {**cfg, "lora_alpha": None}, "lora_alpha=None in .* is not a number"),
    (lambda cfg: {**cfg, "lora_alpha": "16"}, "lora_alpha='16' in .* is not a number"),
    (lambda cfg: {**cfg, "alpha_pattern": {"q_proj[": 4}}, r"alpha_pattern key 'q_proj\[' in .* is not a regular"),
    (lambda cfg: {**cfg, "rank_pattern": ["q_proj"]}, "rank_pattern in .* is not an object"),
    (lambda cfg: {**cfg, "alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\]='x' in .* is not a number"),
])
def test_malformed_config(llm, base, tmp_path, edit, match):
    _refused(llm, _edited_config(base, tmp_path, "cfg", edit), match)


@pytest.mark.parametrize("change, match", [
    (lambda t: t.to(torch.int32), "lora_A.weight' is torch.int32, not floating point"),
    (lambda t: t.index_fill(1, torch.tensor([0]), float("nan")), "lora_A.weight' holds NaN or infinite values"),
    (lambda t: t.index_fill(1, torch.tensor([0]), float("inf")), "lora_A.weight' holds NaN or infinite values"),
])
def test_factors_that_are_not_finite_floats(llm, base, tmp_path, change, match):
    path = make_adapter("llama", base, tmp_path / "t", 0, r=4, target_modules=["q_proj"])
    file = path / "adapter_model.safetensors"
    save_file({k: change(v) if "layers.1" in k and "lora_A" in k else v for k, v in load_file(str(file)).items()},
              str(file))
    _refused(llm, path, match)


def test_rank_over_max_lora_rank_names_the_expert_parameter(tmp_path):
    """A fused expert parameter over max_lora_rank is named with its parameter (gate_up_proj or down_proj: PEFT
    may give gate_up_proj twice the rank r of the config, in rank_pattern)."""
    moe = base_model("qwen2_moe", tmp_path / "moe")
    path = make_adapter("qwen2_moe", moe, tmp_path / "a", 0, r=4, target_modules=[],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        rank_pattern={r".*\.experts\.gate_up_proj": 8})
    _refused(make_llm(moe, max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=4), path,
             r"rank 8 of 'model\.layers\.\d+\.mlp\.experts\.gate_up_proj' exceeds max_lora_rank=4")


def test_zero_rank_factors(llm, base, tmp_path):
    """A module whose lora_A / lora_B have rank 0 ([0, K] / [N, 0]: PEFT never writes them, its r must be positive)
    is refused naming the module (its scaling lora_alpha / r would divide by zero)."""
    path = make_adapter("llama", base, tmp_path / "z", 0, r=4, target_modules=["q_proj", "k_proj"])
    file = path / "adapter_model.safetensors"
    save_file({k: v[:0] if "layers.1.self_attn.k_proj.lora_A" in k else v[:, :0] if "layers.1.self_attn.k_proj.lora_B"
               in k else v for k, v in load_file(str(file)).items()}, str(file))
    _refused(llm, path, r"target module 'model\.layers\.1\.self_attn\.k_proj' has rank 0")


def _bin_of(base, tmp_path, payload, name="pkl"):
    """An adapter folder whose adapter_model.bin is ``torch.save(payload(state dict))``."""
    path = make_adapter("llama", base, tmp_path / name, 0, r=4, target_modules=["q_proj"], safe_serialization=False)
    file = path / "adapter_model.bin"
    torch.save(payload(torch.load(str(file), weights_only=True)), str(file))
    return path


def test_bin_holding_other_objects(llm, base, tmp_path):
    """adapter_model.bin is read with torch.load(weights_only=True): a pickle of any object other than tensors and
    plain containers is refused naming the file (never unpickled), and so is a file that is no pickle at all."""
    path = _bin_of(base, tmp_path, lambda sd: {**sd, "created": datetime.date(2024, 1, 1)})
    _refused(llm, path, r"adapter_model\.bin is refused: torch\.load\(weights_only=True\) reads tensors only "
                        r"\(Unsupported global: GLOBAL datetime\.date")
    (path / "adapter_model.bin").write_bytes(b"not a pickle")
    _refused(llm, path, r"adapter_model\.bin is refused: torch\.load\(weights_only=True\) reads tensors only")


@pytest.mark.parametrize("payload, match", [
    (lambda sd: list(sd.values()), r"adapter_model\.bin holds a list that is not a state dict"),
    (lambda sd: {**sd, "step": 3}, r"adapter_model\.bin holds a dict that is not a state dict"),
])
def test_bin_that_is_not_a_state_dict(llm, base, tmp_path, payload, match):
    _refused(llm, _bin_of(base, tmp_path, payload), match)


def test_folder_without_weights(llm, base, tmp_path):
    path = make_adapter("llama", base, tmp_path / "w", 0, r=4, target_modules=["q_proj"])
    (path / "adapter_model.safetensors").unlink()
    _refused(llm, path, "holds neither adapter_model.safetensors nor adapter_model.bin")
