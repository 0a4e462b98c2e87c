"""StructuredOutputsParams validation: exactly one constraint; bad schema / regex / grammar / choices raise a
ValueError naming the field and the reason (xgrammar's converter is the oracle of what is convertible)."""
import pytest

from sparrow import SamplingParams, StructuredOutputsParams
from sparrow.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs", [
    {"json": SCHEMA}, {"json": '{"type": "string"}'}, {"regex": r"\d{3}-[a-z]+"}, {"choice": ["yes", 'no "quoted"']},
    {"grammar": 'root ::= "a" b\nb ::= [0-9]+'}, {"json_object": True},
    {"json": SCHEMA, "disable_any_whitespace": True}, {"json": None, "regex": None, "choice": ["x"]},
])
def test_valid_constraint_builds_grammar(kwargs):
    so = StructuredOutputsParams(**kwargs)
    assert so.kind in kwargs
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert hash(so.cache_key)


def test_cache_key_ignores_schema_key_order_and_string_form():
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "required": ["a"], "type": "object"}')
    assert a.cache_key == b.cache_key
    assert a.cache_key != StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).cache_key


@pytest.mark.parametrize("kwargs, words", [
    ({}, ["exactly one of", "json", "regex", "choice", "grammar", "json_object", "none is set"]),
    ({"json_object": False}, ["exactly one of", "none is set"]),
    ({"json": SCHEMA, "regex": "a+"}, ["exactly one of", "2 are (json, regex)"]),
    ({"choice": ["a"], "grammar": 'root ::= "a"', "json_object": True}, ["3 are (choice, grammar, json_object)"]),
    ({"json": "{not json"}, ["StructuredOutputsParams.json", "not valid JSON"]),
    ({"json": [1, 2]}, ["StructuredOutputsParams.json", "JSON schema object", "list"]),
    ({"json": {"type": "foo"}}, ["StructuredOutputsParams.json", 'Unsupported type "foo"']),
    ({"regex": "a(b"}, ["StructuredOutputsParams.regex", "parenthesis is not closed"]),
    ({"regex": ""}, ["StructuredOutputsParams.regex", "non-empty"]),
    ({"grammar": "root ::= foo"}, ["StructuredOutputsParams.grammar", 'Rule "foo" is not defined']),
    ({"grammar": "root ::= [z-a]"}, ["StructuredOutputsParams.grammar", "lower bound is larger"]),
    ({"choice": []}, ["StructuredOutputsParams.choice", "non-empty list"]),
    ({"choice": ["a", 3]}, ["StructuredOutputsParams.choice", "non-empty list"]),
    ({"json_object": True, "whitespace_pattern": r"[ ]?"}, ["whitespace_pattern", "not supported"]),
    ({"json_object": True, "disable_any_whitespace": "yes"}, ["disable_any_whitespace", "boolean"]),
])
def test_invalid_constraint_names_the_problem(kwargs, words):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert isinstance(info.value, InvalidRequestError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)


def test_sampling_params_rejects_a_dict():
    with pytest.raises(InvalidRequestError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})
