"""PEFT adapters saved in the older format, ``adapter_model.bin`` (``save_pretrained(..., safe_serialization=False)``:
``torch.save`` of the state dict, read with ``torch.load(weights_only=True)``), on a tiny random Llama: the same
adapter saved both ways gives identical outputs (ids and logprobs), equal to PEFT's greedy ids in fp32 up to the
first near-tie (logprobs within 1e-4); a folder holding both files is read from its safetensors file. What a .bin
may not hold is refused in tests/lora/test_lora_errors.py."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from sparrow import LoRARequest, SamplingParams
from tests.helpers import make_llm
from tests.lora._adapters import DENSE_TARGETS, base_model, make_adapter, peft_greedy
from tests.models._hf_tiny import compare, prompts

NEW = 8
PROMPTS = prompts()
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
LORA = dict(r=4, lora_alpha=8, target_modules=DENSE_TARGETS)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_model("llama", tmp_path_factory.mktemp("lora-bin") / "base")


def _run(llm, path, i):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=LoRARequest(f"a{i}", i,
                                                                                                      str(path)))
    return [o.outputs[0] for o in outs]


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        assert [lp[t].logprob for lp, t in zip(x.logprobs, x.token_ids)] == \
               [lp[t].logprob for lp, t in zip(y.logprobs, y.token_ids)]


def test_bin_adapter_matches_safetensors_and_peft(base, tmp_path):
    st = make_adapter("llama", base, tmp_path / "st", seed=3, **LORA)
    bn = make_adapter("llama", base, tmp_path / "bin", seed=3, safe_serialization=False, **LORA)
    assert (bn / "adapter_model.bin").is_file() and not (bn / "adapter_model.safetensors").exists()
    st_tensors = load_file(str(st / "adapter_model.safetensors"))
    bin_tensors = torch.load(str(bn / "adapter_model.bin"), map_location="cpu", weights_only=True)
    assert st_tensors.keys() == bin_tensors.keys()
    assert all(torch.equal(st_tensors[k], bin_tensors[k]) for k in st_tensors)  # one adapter, saved two ways
    # both files in one folder, the .bin another adapter's: the safetensors file is read
    both = tmp_path / "both"
    shutil.copytree(st, both)
    other = make_adapter("llama", base, tmp_path / "other", seed=4, safe_serialization=False, **LORA)
    shutil.copy(other / "adapter_model.bin", both / "adapter_model.bin")

    llm = make_llm(base, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    base_out = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    from_st, from_bin, from_both = _run(llm, st, 1), _run(llm, bn, 2), _run(llm, both, 3)
    from_other = _run(llm, other, 4)
    _same(from_st, from_bin)
    _same(from_st, from_both)
    assert [o.token_ids for o in from_other] != [o.token_ids for o in from_st]
    assert [o.token_ids for o in base_out] != [o.token_ids for o in from_st]  # the adapter changes the outputs
    compared = 0
    for prompt, out in zip(PROMPTS, from_bin):
        ids, logits = peft_greedy("llama", base, bn, prompt, NEW)
        compared += compare(ids, logits, out)
    assert compared >= 0.5 * NEW * len(PROMPTS), f"only {compared} steps free of near-ties"
