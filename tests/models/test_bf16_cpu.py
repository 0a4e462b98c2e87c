"""bf16 on the CPU (sparrow's default dtype on CPUs with native bf16): the same judgement as the GPU bf16 test
(tests/models/_bf16.py ``bf16_agreement``): against transformers fp32, sparrow's bf16 logprob error
on the fp32 greedy continuation stays within transformers' own bf16 error on the same ids, and free-running
greedy ids equal transformers bf16 up to its first near-tie."""
import pytest

from tests.models._hf_tiny import build, hf_greedy, prompts
from tests.models._bf16 import bf16_agreement
from tests.models.test_gpu_models import ALL, NEW, _overrides


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe", "gemma4"])
def test_bf16_cpu_within_transformers_bf16_error(family, tmp_path):
    hf = build(ALL, family, tmp_path / family, **_overrides(family))
    ps = prompts()
    stats = bf16_agreement(hf, tmp_path / family, ps, [hf_greedy(hf, p, NEW) for p in ps], "cpu")
    assert stats["sparrow_bf16_err_max"] > 0  # bf16 really ran (fp32 would match to ~1e-5)
