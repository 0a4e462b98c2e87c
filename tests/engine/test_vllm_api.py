"""vLLM's LLM API where sparrow mirrors it: TextPrompt / TokensPrompt dicts, CompletionOutput.cumulative_logprob,
RequestOutput.num_cached_tokens, LLM.chat's add_generation_prompt / continue_final_message / chat_template /
chat_template_kwargs (oracle: transformers' own apply_chat_template), and fp32 greedy output that does not depend
on the batch (the same prompt alone and among others in one step)."""
from __future__ import annotations

import math

import pytest

from sparrow import SamplingParams
from sparrow.errors import InvalidRequestError
from tests.helpers import make_llm, tiny_model_dir, tiny_text_model_dir  # noqa: F401  (fixtures)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_text_model_dir):  # noqa: F811
    return make_llm(tiny_text_model_dir, skip_tokenizer_init=False, max_model_len=128, num_kv_blocks=64,
                    block_size=16, max_num_seqs=16)


def test_text_and_tokens_prompt_dicts(llm):
    ref = llm.generate("Hello", GREEDY)[0]
    text = llm.generate({"prompt": "Hello"}, GREEDY)[0]
    ids = llm.generate({"prompt_token_ids": ref.prompt_token_ids}, GREEDY)[0]
    assert text.prompt == "Hello" and text.prompt_token_ids == ref.prompt_token_ids
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="TextPrompt"):
        llm.generate({"text": "Hello"}, GREEDY)


def test_cumulative_logprob(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2))[0]
    c = out.outputs[0]
    want = math.fsum(lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(want, abs=1e-9) and c.cumulative_logprob < 0
    assert llm.generate("Hello", GREEDY)[0].outputs[0].cumulative_logprob is None  # no logprobs asked: vLLM's None


def test_num_cached_tokens(llm):
    prompt = "a shared prefix that spans more than two blocks of sixteen tokens each, then some"
    first = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    # whole blocks of the prompt come from the cache; the last token is always computed (it gives the logits)
    assert again.num_cached_tokens == (n - 1) // 16 * 16 and again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]


@pytest.mark.parametrize("kw", [dict(), dict(add_generation_prompt=False),
                                dict(add_generation_prompt=False, continue_final_message=True),
                                dict(chat_template="{{ messages[0]['content'] }}|{{ mood }}",
                                     chat_template_kwargs={"mood": "calm"})])
def test_chat_template_arguments(llm, kw):
    tok = llm.tokenizer
    want = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=kw.get("add_generation_prompt", True),
                                   continue_final_message=kw.get("continue_final_message", False),
                                   chat_template=kw.get("chat_template"), **kw.get("chat_template_kwargs", {}))
    out = llm.chat(MESSAGES, GREEDY, **kw)[0]
    assert out.prompt == want
    if kw.get("continue_final_message"):
        assert want.endswith("Hel")  # left open inside the assistant's message
    if "chat_template_kwargs" in kw:
        assert want == "hi|calm"


def test_chat_refuses_both_flags(llm):
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        llm.chat(MESSAGES, GREEDY, continue_final_message=True)


def test_fp32_greedy_is_batch_invariant(llm):
    """bf16 matmuls round differently with the batch's shape, fp32 ones (on the CPU, within this tolerance of
    the argmax) do not: the same prompt's greedy tokens alone and among 7 others in one step are the same."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    target = "The same prompt, alone or not"
    alone = llm.generate(target, params)[0].outputs[0].token_ids
    others = [f"another prompt {i} " * (i + 1) for i in range(7)]
    batch = llm.generate(others[:3] + [target] + others[3:], params)
    assert batch[3].prompt == target and batch[3].outputs[0].token_ids == alone


def test_llm_seed_repeats_unseeded_sampling(tiny_model_dir):  # noqa: F811
    """vLLM's LLM(seed=...): requests without their own seed draw from a generator seeded with it, so a fresh
    LLM with the same seed samples the same tokens; another seed, other tokens."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]

    def run(seed):
        llm = make_llm(tiny_model_dir, max_model_len=32, num_kv_blocks=16, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    first = run(3)
    assert run(3) == first
    assert run(4) != first
