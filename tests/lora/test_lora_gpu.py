"""Multi-LoRA on the GPU: the Triton path with CUDA graphs (decode steps replay graphs that read the static
adapter-slot row) against PEFT (transformers fp32 on CPU) on tiny random checkpoints with the head dims the Triton
kernels serve; fp32, ids equal up to the first step where PEFT's top-2 gap is < 1e-3, logprobs within 1e-3. Then
FP8 weights (bf16 activations): the adapters' deltas reach the output, rows of one adapter agree."""
from __future__ import annotations

import pytest

from sparrow import LoRARequest, SamplingParams
from tests.helpers import make_llm
from tests.lora._adapters import DENSE_TARGETS, EXPERT_PARAMS, ROUTER_PARAMS, make_adapter, peft_greedy
from tests.models._hf_tiny import DENSE, FAMILIES, build, compare, prompts

pytestmark = pytest.mark.gpu

NEW = 12
SHAPE = dict(head_dim=64, hidden_size=128, num_attention_heads=4)


@pytest.fixture(scope="module", params=["llama", "qwen2_moe"])
def case(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp("lora-gpu-" + family)
    base = root / "base"
    build(DENSE if family in DENSE else FAMILIES, family, base, **SHAPE)
    moe = family != "llama"
    adapters = [make_adapter(family, base, root / "a1", 1, r=8, lora_alpha=16, target_modules=DENSE_TARGETS,
                             target_parameters=EXPERT_PARAMS + ROUTER_PARAMS if moe else None),
                make_adapter(family, base, root / "a2", 2, r=16, lora_alpha=16, use_rslora=True,
                             target_modules=["q_proj", "o_proj", "down_proj"],
                             target_parameters=EXPERT_PARAMS[:1] if moe else None)]
    return family, base, adapters


def _generate(llm, ps, loras):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
    reqs = [LoRARequest(a.name, int(a.name[1:]), str(a)) if a is not None else None for a in loras]  # a1 -> id 1
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, lora_request=reqs)]


def test_cuda_graphs_mixed_adapters_match_peft(case):
    family, base, (a1, a2) = case
    ps = prompts((5, 19, 27, 9))
    loras = [None, a1, a2, a1]
    llm = make_llm(base, device="cuda", dtype="float32", max_model_len=128, max_num_seqs=4, enable_lora=True,
                   max_loras=2, max_lora_rank=16)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs  # decode runs in graphs
    outs = _generate(llm, ps, loras)
    compared = 0
    for p, a, out in zip(ps, loras, outs):
        ids, logits = peft_greedy(family, base, a, p, NEW)
        compared += compare(ids, logits, out, tie_gap=1e-3, atol=1e-3)
    assert compared >= 0.5 * NEW * len(ps), f"only {compared} steps compared"


def test_fp8_base_with_adapters(case):
    """FP8 weights, bf16 activations: in one batch the same prompt under an adapter, the base model and the adapter
    again: the adapter rows agree with each other and differ from the base row (the deltas reach the output)."""
    family, base, (a1, a2) = case
    llm = make_llm(base, device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=128, max_num_seqs=8,
                   enable_lora=True, max_loras=2, max_lora_rank=16)
    for p in prompts((7, 21)):
        outs = _generate(llm, [p] * 5, [a1, None, a2, a1, a2])
        assert outs[0].token_ids == outs[3].token_ids and outs[2].token_ids == outs[4].token_ids
        assert outs[0].token_ids != outs[1].token_ids and outs[2].token_ids != outs[1].token_ids
