"""Tool-call parsers (hermes, llama3_json, gemma4) and the <think> reasoning parser: the whole-output extraction,
and the stream fed the same text token by token (SmolLM2's tokenizer, decoded incrementally as the server does)
and character by character. The streamed content and argument fragments must concatenate to exactly the
non-streaming result, and json.loads of the arguments must equal the call's arguments as written."""
from __future__ import annotations

import json

import pytest

from sparrow.server.reasoning import ReasoningStream, extract_reasoning
from sparrow.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.helpers import smollm2_gguf

WEATHER = {"city": "San Francisco, \"CA\"", "unit": "celsius", "days": [1, 2.5, -3e2], "ok": True, "x": None,
           "nested": {"k": "é ✓ \\ /", "empty": {}}}


@pytest.fixture(scope="module")
def tokenizer():
    from sparrow.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf())


def token_pieces(tokenizer, text: str) -> list[str]:
    """``text`` as the server's detokenizer streams it: the new text after each token, held while it ends in an
    incomplete character."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces, sent = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        if now.endswith("\ufffd") and k < len(ids):
            continue
        pieces.append(now[len(sent):])
        sent = now
    assert "".join(pieces) == text  # the tokenizer round-trips these texts
    return pieces


def run_stream(parser, pieces: list[str]) -> tuple[str | None, list[dict]]:
    """Feed ``pieces``; check each call's chunks (index, id, type and name first, then only argument
    fragments); return (content or None, [{"id", "name", "arguments"}])."""
    s = parser.stream()
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, calls = "", {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1, d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i not in calls:
                assert i == len(calls) and tc["type"] == "function" and tc["id"] and tc["function"]["name"]
                assert tc["function"]["arguments"] == ""
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[i]["arguments"] += tc["function"]["arguments"]
    assert len({c["id"] for c in calls.values()}) == len(calls)
    return content or None, [calls[i] for i in range(len(calls))]


def check_all_ways(tokenizer, name: str, text: str, want_content, want_calls: list[tuple[str, dict]]):
    """Non-streaming, token-by-token and character-by-character give the same content and calls, and the
    calls are ``want_calls`` ((name, arguments dict) pairs)."""
    parser = get_tool_parser(name)
    content, calls = parser.extract_tool_calls(text)
    assert content == want_content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert got == want_calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    for pieces in (token_pieces(tokenizer, text), list(text), [text]):
        s_content, s_calls = run_stream(parser, pieces)
        assert s_content == content
        assert [(c["name"], c["arguments"]) for c in s_calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


HERMES_CASES = [
    ("I will check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": WEATHER}, ensure_ascii=False)
     + "\n</tool_call>",
     "I will check.\n", [("get_weather", WEATHER)]),
    ("<tool_call>\n" + json.dumps({"name": "a", "arguments": {"x": 1}}) + "\n</tool_call>\n<tool_call>\n"
     + json.dumps({"arguments": {"y": [2]}, "name": "b"}) + "\n</tool_call>", None,
     [("a", {"x": 1}), ("b", {"y": [2]})]),
    ('<tool_call>{"name": "s", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', None, [("s", {"q": "x"})]),
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    ("no tools here, only < and <tool text", "no tools here, only < and <tool text", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes(tokenizer, text, content, calls):
    check_all_ways(tokenizer, "hermes", text, content, calls)


LLAMA_CASES = [
    ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER}), None, [("get_weather", WEATHER)]),
    (json.dumps({"name": "a", "parameters": {"x": 1}}) + "; " + json.dumps({"name": "b", "arguments": {}}), None,
     [("a", {"x": 1}), ("b", {})]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json(tokenizer, text, content, calls):
    check_all_ways(tokenizer, "llama3_json", text, content, calls)


Q = '<|"|>'
GEMMA_CASES = [
    (f"Sure.<|tool_call>call:get_weather{{city:{Q}San Francisco, \"CA\"{Q},unit:{Q}celsius{Q},days:[1,2.5,-3e2],"
     f"ok:true,x:null,nested:{{k:{Q}é ✓ \\ /{Q},empty:{{}}}}}}<tool_call|>", "Sure.", [("get_weather", WEATHER)]),
    (f"<|tool_call>call:a{{x:1}}<tool_call|><|tool_call>call:b.c-d{{}}<tool_call|>", None,
     [("a", {"x": 1}), ("b.c-d", {})]),
    ("plain answer", "plain answer", []),
]


@pytest.mark.parametrize("text,content,calls", GEMMA_CASES)
def test_gemma4(tokenizer, text, content, calls):
    check_all_ways(tokenizer, "gemma4", text, content, calls)


MALFORMED = [
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut off
    ("llama3_json", '{"name": "f", "parameters": {"a": tru}}'),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": [1]}'),
    ("gemma4", "<|tool_call>cal:f{}<tool_call|>"),
    ("gemma4", "<|tool_call>call:f{a:1]<tool_call|>"),
]


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_call_is_content(tokenizer, name, text):
    """A tool call that is not well-formed: the whole output is content, no tool_calls, no exception."""
    assert get_tool_parser(name).extract_tool_calls(text) == (text, [])


def test_registry_names_vllms_parsers():
    assert {"hermes", "llama3_json", "gemma4"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="known: gemma4, hermes, llama3_json"):
        get_tool_parser("qwen")


REASONING_CASES = [
    ("<think>\nLet me think: 2+2.\n</think>\n\nIt is 4.", "\nLet me think: 2+2.\n", "\n\nIt is 4."),
    ("Thinking without a start tag</think>Answer", "Thinking without a start tag", "Answer"),
    ("cut off while thinking <thi", "cut off while thinking <thi", None),
    ("<think></think>only content", None, "only content"),
]


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_split(tokenizer, text, reasoning, content):
    assert extract_reasoning(text) == (reasoning, content)
    for pieces in (token_pieces(tokenizer, text), list(text)):
        s, got = ReasoningStream(), {"reasoning": "", "content": ""}
        for i, p in enumerate(pieces):
            for kind, piece in s.feed(p, final=i == len(pieces) - 1):
                got[kind] += piece
        assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content)
