"""Structured output in the engine, on the tiny random Llama (byte tokenizer, EOS special): every constrained
output is valid by an oracle no one here wrote -- ``jsonschema`` for schemas, ``json.loads`` for JSON objects,
``re.fullmatch`` for regexes, the choice list, and a GrammarMatcher of xgrammar built apart from the engine's for
EBNF grammars -- in batches mixing constraints and unconstrained rows, with n > 1, under preemption, next to
overlapped greedy decode, and while a compile is still running. The random model's unconstrained output is
invalid, so each check also shows the mask was applied."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from sparrow import LLM, SamplingParams, StructuredOutputsParams as SO
from sparrow.errors import InvalidRequestError
from tests.helpers import make_llm

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yy"]}}}
REGEX = r"[a-c]{2,5}@[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "x=" num ";"\nnum ::= [0-9] | [0-9] [0-9]'
CONSTRAINTS = {
    "json": SO(json=SCHEMA, disable_any_whitespace=True), "json_object": SO(json_object=True, disable_any_whitespace=True),
    "regex": SO(regex=REGEX), "choice": SO(choice=CHOICES), "grammar": SO(grammar=GRAMMAR),
}
PROMPTS = ["hello", "The answer is", "{"]


@pytest.fixture(scope="module")
def llm(tiny_eos_model_dir):
    return LLM(str(tiny_eos_model_dir), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
               block_size=16)


@pytest.fixture
def grammars(llm):
    """The engine's GrammarCompilers (made by the engine's first constrained request)."""
    if llm.engine.grammars is None:
        llm.generate(["hi"], SamplingParams(max_tokens=2, structured_outputs=SO(choice=["a"])))
    return llm.engine.grammars


def grammar_accepts(tokenizer, ebnf: str, text: str) -> bool:
    """xgrammar's own matcher (compiled here, apart from the engine) accepts ``text`` as a complete sentence."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=256)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(ebnf))
    return matcher.accept_string(text) and matcher.is_completed()


def check(kind: str, comp, tokenizer) -> None:
    """``comp`` (a CompletionOutput) satisfies constraint ``kind``; a JSON object cut by max_tokens must be a prefix
    the grammar accepts (the random model may emit an unbounded string)."""
    text = comp.text
    if kind == "json_object" and comp.finish_reason == "length":
        assert grammar_accepts_prefix(tokenizer, text), text
        return
    assert comp.finish_reason == "stop", (kind, text, comp.finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert grammar_accepts(tokenizer, GRAMMAR, text), text


def grammar_accepts_prefix(tokenizer, text: str) -> bool:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=256)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema('{"type": "object"}')).accept_string(text)


def check_mixed_batch(llm) -> list[str]:
    """One generate call: every constraint and an unconstrained row per prompt, all in the same steps (greedy);
    each constrained output checked; returns the unconstrained texts."""
    kinds = [*CONSTRAINTS, None]
    prompts = [p for p in PROMPTS for _ in kinds]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=CONSTRAINTS.get(k)) for k in kinds]
    outs = llm.generate(prompts, params * len(PROMPTS))
    for i, out in enumerate(outs):
        kind = kinds[i % len(kinds)]
        if kind is not None:
            check(kind, out.outputs[0], llm.get_tokenizer())
    return [out.outputs[0].text for i, out in enumerate(outs) if kinds[i % len(kinds)] is None]


def test_batch_of_mixed_constraints_greedy(llm):
    free = check_mixed_batch(llm)
    # the bitmask is really applied: the same prompts unconstrained match none of the constraints
    for text in free:
        assert not re.fullmatch(REGEX, text) and text not in CHOICES
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_n_random_samples_each_valid(llm, kind):
    """n = 6 seeded random samples (one matcher per sequence): every one valid, not all the same."""
    out = llm.generate(["hi"], SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=48,
                                              structured_outputs=CONSTRAINTS[kind]))[0]
    assert len(out.outputs) == 6
    for comp in out.outputs:
        check(kind, comp, llm.get_tokenizer())
    assert len({c.text for c in out.outputs}) > 1


def test_ignore_eos_still_ends_when_the_grammar_completes(llm):
    comp = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                               structured_outputs=CONSTRAINTS["regex"]))[0].outputs[0]
    assert comp.finish_reason == "stop" and re.fullmatch(REGEX, comp.text)


def test_preemption_recomputes_without_losing_the_grammar(tiny_eos_model_dir, llm):
    """A pool of 12 blocks of 4 tokens for 6 sequences of 20+ tokens: sequences are preempted and recomputed; each
    output equals the same request run alone on the roomy engine (fp32 greedy)."""
    small = LLM(str(tiny_eos_model_dir), device="cpu", dtype="float32", max_model_len=48, num_kv_blocks=12,
                block_size=4)
    prompts = ["a long prompt of text " + str(i) for i in range(6)]
    kinds = list(CONSTRAINTS) + ["regex"]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=CONSTRAINTS[k]) for k in kinds[:6]]
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    for p, sp, out in zip(prompts, params, got):
        alone = llm.generate([p], sp)[0].outputs[0]
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (alone.token_ids, alone.finish_reason)


def test_overlapped_decode_never_runs_ahead_for_constrained_rows(llm, monkeypatch):
    """Greedy constrained and unconstrained rows together (SPARROW_OVERLAP on): no queued-ahead plan holds a
    constrained sequence, and each output equals the request run alone."""
    sched = llm.engine.scheduler
    plans = []
    for name in ("schedule", "schedule_ahead"):
        real = getattr(sched, name)

        def record(*a, _real=real, **k):
            plan = _real(*a, **k)
            if plan is not None:
                plans.append(plan)
            return plan
        monkeypatch.setattr(sched, name, record)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    cons = SamplingParams(temperature=0, max_tokens=30, structured_outputs=CONSTRAINTS["json"])
    both = llm.generate(["abc", "abc", "xyz"], [free, cons, free])
    assert any(p.queue_next for p in plans)  # the unconstrained rows alone still overlap
    assert not any(p.queue_next and any(i.seq.grammar is not None for i in p.seqs) for p in plans)
    monkeypatch.undo()
    for prompt, sp, out in zip(["abc", "abc", "xyz"], [free, cons, free], both):
        assert out.outputs[0].token_ids == llm.generate([prompt], sp)[0].outputs[0].token_ids


def test_compile_cache_shares_equal_constraints(llm):
    llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True)))
    grammars = llm.engine.grammars
    same = SO(json=json.dumps(SCHEMA, indent=2), disable_any_whitespace=True)  # another spelling of the schema
    assert grammars.cached(same)
    assert grammars.submit(same) is grammars.submit(CONSTRAINTS["json"])
    assert not grammars.cached(SO(json=SCHEMA))  # any_whitespace differs: another grammar


def test_waiting_compile_does_not_block_other_requests(llm, grammars, monkeypatch):
    """A grammar whose compile is held back: the unconstrained request beside it runs to the end first; then the
    compile is released and the constrained one finishes valid."""
    release = threading.Event()
    real = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda key: (release.wait(30), real(key))[1])
    engine = llm.engine
    slow = engine.add_request("hi", SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(regex="z{1,3}q")))
    fast = engine.add_request("hi", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    done = {}
    while fast not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert slow not in done and engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert re.fullmatch("z{1,3}q", done[slow].outputs[0].text)


def test_refused_without_tokenizer_and_with_speculative_decoding(tiny_eos_model_dir):
    no_tok = make_llm(tiny_eos_model_dir, max_model_len=64, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="structured_outputs needs a tokenizer"):
        no_tok.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(structured_outputs=SO(regex="a")))
    spec = LLM(str(tiny_eos_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    with pytest.raises(InvalidRequestError, match="speculative decoding"):
        spec.generate(["hi"], SamplingParams(structured_outputs=SO(regex="a")))


def test_logits_wider_than_the_tokenizer(tmp_path):
    """A model of 320 logits with the 256-token byte tokenizer: the bitmask is sized to the logits and the 64
    tokens the tokenizer lacks are never allowed (random samples all valid, all ids < 256)."""
    from tests.helpers import build_tiny_llama, save_byte_tokenizer

    path = build_tiny_llama(tmp_path / "wide", vocab_size=320)
    save_byte_tokenizer(path)
    wide = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    out = wide.generate(["hi"], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=20,
                                               structured_outputs=CONSTRAINTS["regex"]))[0]
    for comp in out.outputs:
        assert all(t < 256 for t in comp.token_ids), comp.token_ids
        assert re.fullmatch(REGEX, comp.text.rstrip("\x02")), comp.text


def test_min_tokens_banning_the_grammars_end_stops_without_a_bad_token(llm):
    """choice ["ab"] with min_tokens=5: after "ab" the grammar allows only EOS, which min_tokens bans; the token
    sampled from the fully masked row is not appended and the sequence ends there."""
    comp = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=10, min_tokens=5,
                                               structured_outputs=SO(choice=["ab"])))[0].outputs[0]
    assert (comp.text, comp.token_ids, comp.finish_reason) == ("ab", [97, 98], "stop")


def test_failed_compile_fails_only_that_request(llm, grammars, monkeypatch):
    def broken(key):
        raise RuntimeError("compiler exploded")
    monkeypatch.setattr(grammars, "_compile", broken)
    with pytest.raises(InvalidRequestError, match="failed to compile: compiler exploded"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=SO(regex="q{1,4}")))
    monkeypatch.undo()  # the failed compile left the cache: the same constraint compiles again
    comp = llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs=SO(regex="q{1,4}")))[0].outputs[0]
    assert re.fullmatch("q{1,4}", comp.text)


def test_compile_cache_is_bounded_by_bytes(llm, grammars, monkeypatch):
    """With a 1-byte limit only the newest grammar stays cached; requests holding an evicted one still finish."""
    from sparrow.engine import grammar

    monkeypatch.setattr(grammar, "CACHE_LIMIT_BYTES", 1)
    a, b = SO(regex="k{1,2}"), SO(regex="m{1,2}")
    outs = llm.generate(["hi", "hi"], [SamplingParams(max_tokens=6, structured_outputs=so) for so in (a, b)])
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "stop"]
    assert re.fullmatch("k{1,2}", outs[0].outputs[0].text) and re.fullmatch("m{1,2}", outs[1].outputs[0].text)
    grammars.submit(b).result()
    grammars.submit(SO(regex="n{1,2}")).result()
    grammars.submit(SO(regex="p{1,2}"))
    assert not grammars.cached(a) and not grammars.cached(b) and grammars.cached(SO(regex="p{1,2}"))
