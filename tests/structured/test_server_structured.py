"""Structured output over HTTP with the official ``openai`` client: response_format (json_schema, json_object,
text) on chat and completions, vLLM's guided_* fields and ``structured_outputs`` through extra_body, streaming,
and the 400s (bad schema / regex / grammar, two constraints, unknown keys). The tiny random model's outputs are
checked by jsonschema, json.loads, re and the choice list."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import start_server, stop_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yy"]}}}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Give me a and b."}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def client(tiny_eos_model_dir):
    from sparrow import LLM

    llm = LLM(str(tiny_eos_model_dir), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    running = start_server(llm, served_model_name="tiny", api_key="sk-x")
    yield openai.OpenAI(base_url=running.base_url, api_key="sk-x", max_retries=0)
    stop_server(running)


def test_chat_json_schema_response_format(client):
    """response_format json_schema with vLLM's structured_outputs options beside it (compact JSON: the random
    model would otherwise emit whitespace until max_tokens)."""
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                       response_format=JSON_SCHEMA_FORMAT,
                                       extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"


def test_completions_json_schema_response_format_n3(client):
    r = client.completions.create(model="tiny", prompt="ab:", max_tokens=60, temperature=1.0, seed=5, n=3,
                                  extra_body={"response_format": JSON_SCHEMA_FORMAT,
                                              "structured_outputs": {"disable_any_whitespace": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_and_text_formats(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"stop_token_ids": None})
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert reason == "length" and text.lstrip().startswith("{")
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                           response_format={"type": "text"})
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == free.choices[0].message.content


def test_guided_choice_and_regex_via_extra_body(client):
    for endpoint in ("chat", "completions"):
        for extra, ok in [({"guided_choice": ["cat", "dog", "bird"]}, lambda t: t in ("cat", "dog", "bird")),
                          ({"guided_regex": r"[0-9]{2}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{2}", t)),
                          ({"guided_grammar": 'root ::= "v" [0-9]'}, lambda t: re.fullmatch(r"v[0-9]", t)),
                          ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down"))]:
            if endpoint == "chat":
                r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.8,
                                                   seed=1, extra_body=extra)
                text = r.choices[0].message.content
            else:
                r = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0.8, seed=1,
                                              extra_body=extra)
                text = r.choices[0].text
            assert ok(text), (endpoint, extra, text)


def test_streaming_json_schema(client):
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                                    response_format=JSON_SCHEMA_FORMAT, stream=True,
                                                    extra_body=COMPACT)
            parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
        else:
            stream = client.completions.create(model="tiny", prompt="ab:", max_tokens=60, temperature=0, stream=True,
                                               extra_body={"structured_outputs": {"json": SCHEMA,
                                                                                  "disable_any_whitespace": True}})
            parts = [c.choices[0].text for c in stream if c.choices]
        assert len([p for p in parts if p]) > 1
        jsonschema.validate(json.loads("".join(parts)), SCHEMA)


@pytest.mark.parametrize("extra, param, words", [
    ({"guided_regex": "a(b"}, "guided_regex", ["parenthesis is not closed"]),
    ({"guided_json": {"type": "foo"}}, "guided_json", ['Unsupported type "foo"']),
    ({"guided_grammar": "root ::= nope"}, "guided_grammar", ['Rule "nope" is not defined']),
    ({"guided_choice": []}, "guided_choice", ["non-empty list"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", ["guided_regex, guided_choice", "at most one"]),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     ["response_format, guided_regex"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", ["text", "json_object", "json_schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema",
     ["Field required"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["exactly one", "regex, choice"]),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", ["structured_outputs.regexp", "unknown key"]),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", ["none is set"]),
])
def test_bad_constraints_are_400_naming_the_field(client, extra, param, words):
    for call in (lambda: client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra),
                 lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                        extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        err = info.value.body
        assert err["param"] == param, err
        for word in words:
            assert word in err["message"], (word, err)
        assert "Traceback" not in err["message"] and ".cc:" not in err["message"]
