"""Multi-LoRA against PEFT (transformers fp32, CPU): tiny random Llama (dense), Qwen2-MoE (routed experts,
sigmoid-gated shared expert, dense layers between MoE layers) and Gemma 4 (k_eq_v full layers, dense MLP beside
the MoE, the experts' weighted reduce fused into the closing norm) with PEFT adapters made here, random A and B.

One batch mixes the base model and the adapters (prefill chunks and decode rows of different adapters share
steps; a 19- or 27-token MoE prefill takes the grouped expert path, decode the per-pair path). Each prompt's
greedy ids equal PEFT's up to the first near-tie (top-2 gap < 1e-4) and logprobs are within 1e-4.
Gemma 4's adapters are Qwen2-MoE's without the router (its scaled router is not adaptable). Qwen2-MoE adapters:
one on every attention projection, the dense and shared-expert MLPs, both fused 3-D expert
tensors (PEFT target_parameters) and the router (mlp.gate.weight); one rsLoRA of another rank on q / v, the
experts' down_proj and the router; and the first re-saved with per-expert module names (experts.N.gate_proj /
up_proj / down_proj: PEFT's ParamWrapper layout unstacked), which must give the first's outputs (Llama: a plain
copy under another id). Three adapters in one batch with max_loras=2: the scheduler holds back what does not fit
(a step with more adapters than slots raises in ``LoRAManager.assign``).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow import LoRARequest, SamplingParams
from sparrow.errors import InvalidRequestError, LoRAAdapterError
from tests.helpers import make_llm
from tests.lora._adapters import DENSE_TARGETS, EXPERT_PARAMS, GEMMA4_EXPERTS, ROUTER_PARAMS, base_model, make_adapter, \
    peft_greedy
from tests.models._hf_tiny import compare, prompts

NEW = 8
PROMPTS = prompts()


def _params():
    return SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)


def _per_expert_copy(src, dst, experts: int, experts_module: str) -> None:
    """Re-save a fused-experts PEFT adapter with per-expert module names (expert e's A rows e r .. e r + r - 1,
    its B columns j E + e: PeftModel's ParamWrapper layout)."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    for key in ("rank_pattern", "alpha_pattern"):  # PEFT >= 0.22 keys the fused gate_up_proj's rank 2r / alpha 2a
        pattern = cfg.get(key) or {}
        for name, value in list(pattern.items()):
            if name.endswith("gate_up_proj"):
                pattern[name.removesuffix("gate_up_proj") + r"\d+\.(gate_proj|up_proj)"] = value
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    out = {}
    for key, t in load_file(str(src / "adapter_model.safetensors")).items():
        if f".{experts_module}." not in key:
            out[key] = t
            continue
        module, which = key.split(".lora_")
        which = "lora_" + which
        stacked = "gate_up" if module.endswith(".base_layer") else "down"
        module = module.removesuffix(".base_layer")
        for e in range(experts):
            if which.startswith("lora_A"):
                part = t.reshape(experts, -1, t.shape[1])[e]
                names = ["gate_proj", "up_proj"] if stacked == "gate_up" else ["down_proj"]
                for n in names:
                    out[f"{module}.{e}.{n}.{which}"] = part.clone()
            else:
                part = t.reshape(t.shape[0], -1, experts)[:, :, e]
                if stacked == "gate_up":
                    half = part.shape[0] // 2
                    out[f"{module}.{e}.gate_proj.{which}"] = part[:half].clone()
                    out[f"{module}.{e}.up_proj.{which}"] = part[half:].clone()
                else:
                    out[f"{module}.{e}.down_proj.{which}"] = part.clone()
    save_file(out, str(dst / "adapter_model.safetensors"))


class Case:
    def __init__(self, family, root):
        self.family, self.base = family, root / "base"
        base_model(family, self.base)
        experts, router = {"qwen2_moe": (EXPERT_PARAMS, ROUTER_PARAMS), "gemma4": (GEMMA4_EXPERTS, [])}.get(
            family, ([], []))
        self.adapters = [
            make_adapter(family, self.base, root / "a1", 1, r=4, lora_alpha=8, target_modules=DENSE_TARGETS,
                         target_parameters=experts + router or None),
            make_adapter(family, self.base, root / "a2", 2, r=6, lora_alpha=16, use_rslora=True,
                         target_modules=["q_proj", "v_proj"], target_parameters=experts[1:] + router or None),
        ]
        # the oracle: each prompt under the base model and each adapter
        self.ref = {a: [peft_greedy(family, self.base, a, p, NEW) for p in PROMPTS] for a in [None, *self.adapters]}
        base_ids = [ids for ids, _ in self.ref[None]]
        for a in self.adapters:  # each adapter changes the outputs (a2 on MoE: mostly its experts and router)
            assert [ids for ids, _ in self.ref[a]] != base_ids, a


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp("lora-" + request.param))


def _request(path, i):
    return LoRARequest(f"a{i}", i, str(path)) if path is not None else None


@pytest.mark.parametrize("case", ["llama", "qwen2_moe", "gemma4"], indirect=True)
def test_mixed_batch_matches_peft(case, tmp_path):
    a1, a2 = case.adapters
    a3 = tmp_path / "a1-again"  # a third adapter with a1's weights (MoE: under per-expert module names)
    if case.family == "qwen2_moe":
        _per_expert_copy(a1, a3, 16, "mlp.experts")
    else:
        shutil.copytree(a1, a3)
    # two batches mixing the base model and two adapters, then three adapters with two slots
    runs = [(None, a1, a2), (a2, None, a1), (a3, a1, a2)]
    llm = make_llm(case.base, max_model_len=128, max_num_batched_tokens=24, enable_lora=True, max_loras=2,
                   max_lora_rank=8)
    compared = 0
    for run in runs:
        reqs = [_request(a, {None: 0, a1: 1, a2: 2}.get(a, 3)) for a in run]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), lora_request=reqs)
        for i, (a, out) in enumerate(zip(run, outs)):
            assert out.lora_request == reqs[i]  # each output names the adapter it ran with (vLLM's field)
            ids, logits = case.ref[a1 if a not in case.ref else a][i]
            compared += compare(ids, logits, out.outputs[0])
    assert compared >= 0.5 * NEW * len(PROMPTS) * len(runs), f"only {compared} steps free of near-ties"


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_get_metrics_names_running_and_waiting_adapters(case):
    """``LLM.get_metrics()``' lora_requests_info (the server gauge's labels): with one adapter slot, a1's first
    request and the base model's run; a2's waits, and a1's second waits behind it; when all are done, none."""
    a1, a2 = case.adapters
    llm = make_llm(case.base, max_model_len=128, block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8)
    info = lambda: llm.get_metrics()["sparrow:lora_requests_info"]  # noqa: E731
    assert info() == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": 1}
    for path, prompt in [(a1, 0), (None, 1), (a2, 2), (a1, 0)]:
        llm.engine.add_request({"prompt_token_ids": PROMPTS[prompt]}, _params(),
                               lora_request=_request(path, 1 if path == a1 else 2))
    assert info() == {"running_lora_adapters": "", "waiting_lora_adapters": "a1,a2", "max_lora": 1}
    llm.engine.step()
    assert info() == {"running_lora_adapters": "a1", "waiting_lora_adapters": "a2,a1", "max_lora": 1}
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert info() == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": 1}
    assert "sparrow:lora_requests_info" not in make_llm(case.base, max_model_len=128).get_metrics()


@pytest.mark.parametrize("case", ["llama", "qwen2_moe"], indirect=True)
def test_prefix_cache_keys_blocks_by_adapter(case):
    a1, a2 = case.adapters
    llm = make_llm(case.base, max_model_len=128, block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    p = PROMPTS[2]

    def run(adapter, i):
        before = llm.get_metrics()["sparrow:prefix_cache_hits"]
        out = llm.generate({"prompt_token_ids": p}, _params(), lora_request=_request(adapter, i))[0].outputs[0]
        return llm.get_metrics()["sparrow:prefix_cache_hits"] - before, out

    assert run(a1, 1)[0] == 0
    hits, out = run(a2, 2)  # the same prompt under another adapter: no block shared
    assert hits == 0
    compare(*case.ref[a2][2], out)
    hits, out = run(None, 0)  # nor with the base model
    assert hits == 0
    compare(*case.ref[None][2], out)
    hits, out = run(a1, 1)  # the same adapter again: its blocks are found
    assert hits > 0
    compare(*case.ref[a1][2], out)


@pytest.mark.parametrize("case", ["llama", "qwen2_moe"], indirect=True)
def test_speculative_verify_rows_run_each_adapter(case):
    """n-gram speculation: the verify rows (k + 1 a sequence) of a mixed batch carry their sequence's adapter, so
    greedy output is still PEFT's."""
    a1, a2 = case.adapters
    llm = make_llm(case.base, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                       "prompt_lookup_min": 1})
    run = (a1, None, a2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(),
                        lora_request=[_request(a, i) for i, a in zip((1, 0, 2), run)])
    assert llm.get_metrics()["sparrow:spec_decode_num_draft_tokens"] > 0  # verify steps ran
    for i, (a, out) in enumerate(zip(run, outs)):
        compare(*case.ref[a][i], out.outputs[0])



@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_draft_model_runs_without_adapters(case):
    """A draft model (here the base itself) proposes for a target that runs adapters: greedy output is still PEFT's,
    and the draft holds no adapter slots (it runs the base model only: slots would be device memory and, in its
    CUDA graphs, LoRA launches on every draft step for nothing)."""
    a1, a2 = case.adapters
    llm = make_llm(case.base, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8,
                   speculative_config={"method": "draft_model", "model": str(case.base), "num_speculative_tokens": 3})
    draft = llm.engine.spec.proposer.runner
    assert draft.lora is None and all(m.lora is None for m in draft.model.modules() if hasattr(m, "lora"))
    run = (a1, None, a2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(),
                        lora_request=[_request(a, i) for i, a in zip((1, 0, 2), run)])
    assert llm.get_metrics()["sparrow:spec_decode_num_draft_tokens"] > 0
    for i, (a, out) in enumerate(zip(run, outs)):
        compare(*case.ref[a][i], out.outputs[0])

def test_router_alone_and_experts_alone(tmp_path):
    """Qwen2-MoE adapters on the router only and on the routed experts only: each changes PEFT's output, and
    sparrow's matches it (so neither delta path can be silently dropped)."""
    base = base_model("qwen2_moe", tmp_path / "base")
    only = {"router": make_adapter("qwen2_moe", base, tmp_path / "router", 3, scale=2.0, r=4, target_modules=[],
                                   target_parameters=ROUTER_PARAMS),
            "experts": make_adapter("qwen2_moe", base, tmp_path / "experts", 4, scale=2.0, r=4, target_modules=[],
                                    target_parameters=EXPERT_PARAMS)}
    ps = PROMPTS[:2]
    base_ids = [peft_greedy("qwen2_moe", base, None, p, NEW)[0] for p in ps]
    llm = make_llm(base, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=4)
    for i, (what, a) in enumerate(only.items(), 1):
        ref = [peft_greedy("qwen2_moe", base, a, p, NEW) for p in ps]
        assert [ids for ids, _ in ref] != base_ids, f"the {what} adapter does not change PEFT's output"
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], _params(), lora_request=_request(a, i))
        assert sum(compare(ids, logits, o.outputs[0]) for (ids, logits), o in zip(ref, outs)) >= NEW


def test_alpha_and_rank_patterns_of_target_parameters(tmp_path):
    """PEFT keys alpha_pattern / rank_pattern of a target parameter by ``<module>.<parameter>``
    (``mlp.experts.down_proj``, ``mlp.gate.weight``), as it writes them itself when it turns target_modules
    gate_proj / up_proj on fused experts into target_parameters: each parameter's scaling is its own alpha over its
    own rank, and sparrow's outputs match PEFT's."""
    base = base_model("qwen2_moe", tmp_path / "base")
    a = make_adapter("qwen2_moe", base, tmp_path / "a", 5, scale=1.0, r=2, lora_alpha=2, target_modules=[],
                     target_parameters=EXPERT_PARAMS + ROUTER_PARAMS,
                     rank_pattern={r".*\.experts\.gate_up_proj": 4},
                     alpha_pattern={r".*\.experts\.gate_up_proj": 32, r".*\.experts\.down_proj": 24,
                                    r".*\.gate\.weight": 16})
    ref = [peft_greedy("qwen2_moe", base, a, p, NEW) for p in PROMPTS]
    llm = make_llm(base, max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), lora_request=_request(a, 1))
    assert sum(compare(ids, logits, o.outputs[0]) for (ids, logits), o in zip(ref, outs)) >= NEW
