"""Speculative decoding in the engine on tiny random Llamas (CPU, fp32): greedy output and logprobs identical to
plain decoding with the n-gram and the draft-model proposer, limits never overshot, KV slots of rejected drafts
given back and reused, nothing leaked by an abort, the prefix cache unchanged by drafts."""
from __future__ import annotations

import pytest
import torch

from sparrow import SamplingParams
from tests.helpers import (build_tiny_llama, generate_ids, ids_prompt, make_llm, random_prompts,  # noqa: F401
                           tiny_model_dir, tiny_text_model_dir)  # (fixtures)

# larger weights than the shared tiny model: logits far from ties, and greedy falls into loops the n-gram
# proposer can predict
SHARP = dict(initializer_range=0.25)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("spec") / "target", seed=3, **SHARP)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    """The target with noise on every weight: its drafts are often, not always, the target's tokens."""
    return noisy_copy(target_dir, tmp_path_factory.mktemp("spec") / "draft", scale=0.08)


def noisy_copy(src, dst, scale: float, seed: int = 0):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(dst), safe_serialization=True)
    return dst


@pytest.fixture(scope="module")
def plain(target_dir):
    return make_llm(target_dir, num_kv_blocks=64, block_size=4, max_model_len=128)


SPECS = {
    "ngram": lambda d: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft": lambda d: {"method": "draft_model", "model": str(d), "num_speculative_tokens": 4},
}


@pytest.fixture(scope="module", params=list(SPECS))
def spec(request, target_dir, draft_dir):
    return make_llm(target_dir, num_kv_blocks=64, block_size=4, max_model_len=128, speculative_config=SPECS[request.param](draft_dir))


PROMPTS = random_prompts([5, 9, 3, 14], seed=7) + [[5, 6, 7, 5, 6, 7, 5, 6]]


def test_greedy_ids_and_logprobs_equal_plain_decoding(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True)
    ref = plain.generate([ids_prompt(p) for p in PROMPTS], params)
    got = spec.generate([ids_prompt(p) for p in PROMPTS], params)
    m = spec.get_metrics()
    assert m["sparrow:spec_decode_num_drafts"] > 0 and m["sparrow:spec_decode_num_accepted_tokens"] > 0
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) and b[t].rank == a[t].rank


def test_seeded_sampling_does_not_depend_on_step_timing(target_dir):
    """A seeded request's tokens are the same whether the timing rule (``SpeculativeDecoder.pays``) would verify
    drafts or not, and while the batch's drafting is paused, with an unseeded request beside it: a verify step
    draws more numbers from the sequence's generator than a decode step, so skipping one would move every later
    token."""
    llm = make_llm(target_dir, num_kv_blocks=64, block_size=4, max_model_len=128,
                   speculative_config=SPECS["ngram"](None))
    dec = llm.engine.spec
    seeded = SamplingParams(temperature=0.3, seed=1234, n=2, max_tokens=30, ignore_eos=True)
    prompts = [ids_prompt(PROMPTS[4]), ids_prompt(PROMPTS[0])]
    runs, drafts = [], []
    for verdict, hold in ((True, 0), (False, 0), (False, 10**6)):
        dec.pays = lambda *a, v=verdict, **k: v  # noqa: E731
        dec._hold_until = dec._steps + hold
        before = dec.num_drafts
        out = llm.generate(prompts, [seeded, SamplingParams(temperature=0.3, max_tokens=30, ignore_eos=True)])
        runs.append([c.token_ids for c in out[0].outputs])
        drafts.append(dec.num_drafts - before)
    assert runs[0] == runs[1] == runs[2]
    assert min(drafts) > 0 and runs[0][0] != runs[0][1]  # verify steps ran in each; the two samples differ


def test_stop_tokens_and_max_tokens_never_overshot(plain, spec):
    ids = generate_ids(plain, PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for prompt, full in zip(PROMPTS, ids):
        stop = full[11]
        first = full.index(stop)
        for params, want in ((SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True),
                              full[:first + 1]),
                             (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), full[:7])):
            out = spec.generate(ids_prompt(prompt), params)[0].outputs[0]
            assert out.token_ids == want


def test_draft_vocabulary_padding_and_another_tokenizer(plain, target_dir, tmp_path):
    """A draft whose vocabulary lacks up to 128 of the target's tokens (padding, as Qwen2.5's sizes differ) runs:
    a sequence holding a token past it gets no drafts, and greedy output is plain decoding's. One that lacks more
    (another tokenizer) is refused when the LLM is built, naming both sizes."""
    from sparrow.errors import InvalidRequestError

    padded = build_tiny_llama(tmp_path / "padded", seed=3, vocab_size=200, **SHARP)
    llm = make_llm(target_dir, num_kv_blocks=64, block_size=4, max_model_len=128,
                   speculative_config={"method": "draft_model", "model": str(padded), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [ids_prompt(p) for p in PROMPTS] + [ids_prompt([250, 7, 8, 9])]  # 250: past the draft's 200
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.get_metrics()["sparrow:spec_decode_num_drafts"] > 0
    other = build_tiny_llama(tmp_path / "other", vocab_size=64)
    with pytest.raises(InvalidRequestError, match=r"draft model vocabulary \(64 tokens\) is smaller than the "
                                                  r"target's \(256\) by more than padding"):
        make_llm(target_dir, max_model_len=128,
                 speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 3})


def test_n_and_prompt_logprobs_keep_working(plain, spec):
    params = SamplingParams(n=2, temperature=0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    ref, got = plain.generate(ids_prompt(PROMPTS[1]), params)[0], spec.generate(ids_prompt(PROMPTS[1]), params)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert [None if d is None else sorted(d) for d in got.prompt_logprobs] == \
           [None if d is None else sorted(d) for d in ref.prompt_logprobs]


def _free(llm) -> tuple[int, int | None]:
    e = llm.engine
    draft = getattr(e.spec.proposer, "bm", None)
    return e.block_manager.num_free_blocks, (draft.num_free_blocks if draft is not None else None)


def test_rejected_slots_are_given_back(spec):
    before = _free(spec)
    # many sequences share the 64-block pool (256 slots): rejected drafts' blocks must come back for the run to
    # finish, and all of them are free once it did
    spec.generate([ids_prompt(p) for p in random_prompts([6] * 12, seed=11)],
                  SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    m = spec.get_metrics()
    assert m["sparrow:spec_decode_num_draft_tokens"] > m["sparrow:spec_decode_num_accepted_tokens"]
    assert _free(spec) == before


def test_abort_mid_verify_leaks_nothing(target_dir, draft_dir):
    llm = make_llm(target_dir, num_kv_blocks=64, block_size=4, max_model_len=128,
                   speculative_config=SPECS["draft"](draft_dir))
    e, before = llm.engine, _free(llm)
    rid = e.add_request(ids_prompt(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    while e.spec.num_drafts == 0 and rid in e.requests:  # up to the first step that verified drafts
        e.step()
    assert rid in e.requests and e.spec.num_drafts == 1
    e.abort(rid)
    llm.generate(ids_prompt(PROMPTS[1]), SamplingParams(temperature=0, max_tokens=3))  # the proposer forgets it
    assert _free(llm) == before and not e.scheduler.running


def test_prefix_cache_holds_only_prompt_blocks(spec):
    bm = spec.engine.block_manager
    prompt = random_prompts([17], seed=5)[0]
    spec.generate(ids_prompt(prompt), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    # every registered block hash names a prefix of some prompt: 17 prompt tokens, blocks of 4 -> 4 full blocks
    # of this prompt at most (the one holding the last prompt token is never registered)
    hashes, h = set(), None
    for i in range(4):
        h = hash((h, tuple(prompt[4 * i:4 * i + 4])))
        hashes.add(h)
    mine = {x for x in bm.hash_to_block if x in hashes}
    assert len(mine) == 4
    total_prompt_blocks = sum((len(p) - 1) // 4 for p in PROMPTS) + 4 + 12 + 4
    assert len(bm.hash_to_block) <= total_prompt_blocks


def test_stop_strings_are_never_overshot(tiny_text_model_dir):  # noqa: F811
    """A stop string inside the greedy text: with n-gram speculation the text ends where plain decoding's does,
    the stop string cut (several tokens may be accepted in the step that completes it)."""
    from sparrow import LLM

    kw = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64)
    plain = LLM(str(tiny_text_model_dir), **kw)
    spec = LLM(str(tiny_text_model_dir), **kw, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    full = plain.generate("abcabc", SamplingParams(**greedy))[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    want = plain.generate("abcabc", SamplingParams(stop=[stop], **greedy))[0].outputs[0]
    got = spec.generate("abcabc", SamplingParams(stop=[stop], **greedy))[0].outputs[0]
    assert (got.text, got.token_ids, got.stop_reason) == (want.text, want.token_ids, stop)
    assert spec.get_metrics()["sparrow:spec_decode_num_drafts"] > 0
