"""The engine features that must work unchanged with an FP8 KV cache, on CPU: prefix caching, preemption,
speculative verify (n-gram) and LoRA (mixed adapter batches)."""
from __future__ import annotations

from sparrow import SamplingParams
from tests.helpers import generate_ids, ids_prompt, make_llm, random_prompts, tiny_model_dir  # noqa: F401
from tests.kv_cache.test_fp8_kv import GREEDY
from tests.models._hf_tiny import prompts


def test_prefix_caching_and_preemption_with_fp8(tiny_model_dir):
    """The same fp8 tokens with prefix caching off / on and with a pool small enough to preempt."""
    (shared,) = random_prompts([70], seed=11)
    ps = [shared + t for t in random_prompts([5, 9, 1], seed=12)] + random_prompts([40, 50], seed=10)
    sp = SamplingParams(max_tokens=30, **GREEDY)
    ref = generate_ids(make_llm(tiny_model_dir, kv_cache_dtype="fp8", enable_prefix_caching=False), ps, sp)
    cached = make_llm(tiny_model_dir, kv_cache_dtype="fp8")
    assert [generate_ids(cached, [p], sp)[0] for p in ps] == ref
    assert cached.engine.block_manager.prefix_cache_hits >= 2 * 64  # prompts 1 and 2 reuse 4 blocks of prompt 0
    small = make_llm(tiny_model_dir, kv_cache_dtype="fp8", num_kv_blocks=13, max_model_len=128)
    assert generate_ids(small, ps, sp) == ref
    assert small.engine.scheduler.num_preemptions > 0


def test_speculative_verify_with_fp8(tiny_model_dir):
    """n-gram speculation over an fp8 cache: the greedy ids of plain fp8 decoding."""
    ps = random_prompts([5, 9], seed=7) + [[5, 6, 7, 5, 6, 7, 5, 6]]
    sp = SamplingParams(max_tokens=16, **GREEDY)
    plain = generate_ids(make_llm(tiny_model_dir, kv_cache_dtype="fp8", max_model_len=128), ps, sp)
    spec = make_llm(tiny_model_dir, kv_cache_dtype="fp8", max_model_len=128,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert generate_ids(spec, ps, sp) == plain


def test_lora_with_fp8(tmp_path):
    """LoRA over an fp8 cache: a batch mixing adapter and base rows gives each row's tokens of running it alone
    (fp8 too), the adapter changes them, and it agrees with the auto cache at the steps clear of near-ties."""
    from sparrow import LoRARequest
    from tests.lora._adapters import DENSE_TARGETS, base_model, make_adapter

    base = tmp_path / "base"
    base_model("llama", base)
    adapter = make_adapter("llama", base, tmp_path / "a1", 1, r=4, lora_alpha=8, target_modules=DENSE_TARGETS)
    req = LoRARequest("a1", 1, str(adapter))
    ps = [ids_prompt(p) for p in prompts()]
    sp = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    kw = dict(max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8)
    fp8 = make_llm(base, kv_cache_dtype="fp8", **kw)
    mixed = [o.outputs[0].token_ids for o in fp8.generate(ps, sp, lora_request=[req, None, req])]
    alone = [fp8.generate(p, sp, lora_request=r)[0].outputs[0].token_ids for p, r in zip(ps, [req, None, req])]
    assert mixed == alone
    assert [o.outputs[0].token_ids for o in fp8.generate(ps, sp)][0] != mixed[0]
    auto = make_llm(base, **kw)
    outs = auto.generate(ps, sp, lora_request=req)
    refs = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    tf = fp8.generate([ids_prompt(p + g) for p, g, _ in refs], SamplingParams(max_tokens=1, prompt_logprobs=1),
                      lora_request=req)
    hits = [o.prompt_logprobs[len(p) + j][t].rank == 1 for o, (p, g, lps) in zip(tf, refs) for j, t in enumerate(g)
            if (lambda top: top[0] - top[1])(sorted((x.logprob for x in lps[j].values()), reverse=True)) >= 0.1]
    assert len(hits) >= 8 and sum(hits) >= 0.9 * len(hits), hits
