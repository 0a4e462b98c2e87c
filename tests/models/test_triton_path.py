"""The whole Triton path (attention, KV write, norms, activations, router and MoE kernels) run end to end
under the interpreter on CPU, against transformers on the same tiny checkpoint: ids equal up to the first
step where transformers' top-2 gap is < 1e-3, logprobs within 1e-3 (fp32). The GPU twin of this test is
tests/models/test_gpu_models.py."""
import pytest

from sparrow import SamplingParams
from sparrow.kernels import backend
from tests.helpers import make_llm
from tests.models._hf_tiny import DENSE, FAMILIES, build, compare, hf_greedy, prompts

CASES = {"llama": (DENSE, dict(head_dim=64, hidden_size=128)),
         "gemma3": (DENSE, dict(head_dim=64, hidden_size=128)),
         "qwen3_moe": (FAMILIES, dict(head_dim=64, hidden_size=128)),
         "gemma4": (FAMILIES, dict(head_dim=64, global_head_dim=128, hidden_size=128))}


@pytest.mark.parametrize("family", list(CASES))
def test_triton_path_matches_transformers(family, tmp_path):
    table, shape = CASES[family]
    hf = build(table, family, tmp_path / family, **shape)
    ps = prompts()[:2]
    ref = [hf_greedy(hf, p, 6) for p in ps]
    with backend("triton"):
        llm = make_llm(tmp_path / family, max_model_len=64)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True))
    compared = sum(compare(i, lg, o.outputs[0], tie_gap=1e-3, atol=1e-3) for (i, lg), o in zip(ref, outs))
    assert compared >= 6, f"only {compared} steps compared"
