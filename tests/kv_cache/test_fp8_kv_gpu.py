"""FP8 KV cache on the GPU (Triton kernels, CUDA graphs): the packaged Gemma 3 270M in bf16 agrees with the bf16
cache (teacher-forced top-1 >= 0.9, the CPU criterion of test_fp8_kv.py), and scales changed in place after a
CUDA graph was captured reach its replay."""
from __future__ import annotations

import pytest

from sparrow import LLM
from tests.kv_cache.test_fp8_kv import TEXT_PROMPTS, greedy_refs, teacher_forced

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gemma() -> str:
    from sparrow.default_model import default_model_path

    return str(default_model_path())


def test_gemma3_fp8_cache_agrees_with_bf16_on_the_gpu():
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    refs = greedy_refs(LLM(_gemma(), **kw), TEXT_PROMPTS, 24)
    fp8 = LLM(_gemma(), kv_cache_dtype="fp8", **kw)
    agree, drift = teacher_forced(fp8, refs)
    assert agree >= 0.9 and drift < 0.1, (agree, drift)


def test_scale_updates_reach_a_captured_graph():
    """Scales are device tensors read by the kernels: changed in place after capture, the replay uses them."""
    import torch

    from sparrow.kernels.attention.attention import paged_decode_attention
    from sparrow.kernels.attention.paged_attention import paged_attention_ref
    from sparrow.kv_cache.cache import LayerKVCache
    from tests.kernels.attention.test_kv_fp8 import fp8_batch

    batch = fp8_batch([1, 1, 1], [20, 33, 40], hq=4, hkv=2, d=64, q_dtype=torch.bfloat16, k_scale=0.02, v_scale=0.03)
    layer = LayerKVCache(0, batch[1], batch[2])
    layer.set_scales(0.02, 0.03)
    run = lambda: paged_decode_attention(*batch, 0.125, k_scale=layer.k_scale, v_scale=layer.v_scale,
                                         max_seq_len=64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    layer.set_scales(0.04, 0.06)
    graph.replay()
    want = paged_attention_ref(*batch, 0.125, k_scale=layer.k_scale, v_scale=layer.v_scale)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
