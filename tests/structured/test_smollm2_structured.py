"""Structured output on the packaged SmolLM2-135M-Instruct (GGUF; its tokenizer is built from the file's
vocabulary): one batch of chat requests, each with another constraint plus an unconstrained one, validated by
jsonschema, json.loads, re, the choice list and a GrammarMatcher of xgrammar built apart from the engine's."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sparrow import LLM, SamplingParams, StructuredOutputsParams as SO
from tests.helpers import smollm2_gguf

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 150}}}
PHONE = r"\d{3}-\d{4}"
GRAMMAR = 'root ::= ("Yes" | "No") ", because " [a-z ]{1,24} "."'


@pytest.fixture(scope="module")
def llm():
    return LLM(str(smollm2_gguf()), device="cpu", dtype="float32", max_model_len=256)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_smollm2_batch_of_constraints(llm):
    cases = [
        (ask("Describe Bob, who is 30, as JSON."), SO(json=SCHEMA, disable_any_whitespace=True)),
        (ask('Answer in JSON with the key "answer": is the sky blue?'), SO(json_object=True,
                                                                          disable_any_whitespace=True)),
        (ask("Make up a phone number."), SO(regex=PHONE)),
        (ask("Is water wet? Answer yes or no."), SO(choice=["yes", "no"])),
        (ask("Is fire hot? Say why."), SO(grammar=GRAMMAR)),
        (ask("Make up a phone number."), None),
    ]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for _, so in cases]
    params[-1] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.chat([c for c, _ in cases], params)]
    for out in outs[:5]:
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert isinstance(json.loads(outs[1].text), dict)
    assert re.fullmatch(PHONE, outs[2].text)
    assert outs[3].text in ("yes", "no")
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(llm.get_tokenizer(), vocab_size=llm.config.model.vocab_size)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(GRAMMAR))
    assert matcher.accept_string(outs[4].text) and matcher.is_completed(), outs[4].text
    # the mask is really applied: the same question unconstrained is not a bare phone number
    assert not re.fullmatch(PHONE, outs[5].text), outs[5].text
