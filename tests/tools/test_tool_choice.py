"""tool_choice plans (vLLM's schemas for required / named), assistant tool calls and tool messages through a
chat template (transformers' own rendering of the same conversation is the oracle), and a choice's output
pipeline (reasoning, then tool calls) streamed token by token against the whole message."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from sparrow.server.protocol import ChatCompletionRequest
from sparrow.server.serving import ApiError
from sparrow.server.tool_choice import ChoiceOutput, plan_tools
from tests.helpers import smollm2_gguf
from tests.tools.test_tool_parsers import token_pieces

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "ping"}}]
AUTO = SimpleNamespace(enable_auto_tool_choice=True, tool_call_parser="hermes")
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} city={{ c.function.arguments.city }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from sparrow.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf())


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("parallel", [None, False])
def test_required_schema(parallel):
    plan = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel), AUTO)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good[:1], plan.schema)
    if parallel is False:
        assert plan.schema["maxItems"] == 1
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good, plan.schema)
    else:
        jsonschema.validate(good, plan.schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plan.schema)


def test_named_and_default_plans():
    named = plan_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       AUTO)
    assert (named.mode, named.name, named.schema) == ("named", "get_weather", PARAMS)
    assert plan_tools(request(tools=TOOLS), AUTO).mode == "auto"
    assert plan_tools(request(), AUTO).mode == "none"
    with pytest.raises(ApiError, match="requires --enable-auto-tool-choice"):
        plan_tools(request(tools=TOOLS), SimpleNamespace(enable_auto_tool_choice=False, tool_call_parser=None))


def test_tool_messages_reach_the_template(tokenizer):
    from sparrow.tokenizer import apply_chat_template

    tok = tokenizer
    old = tok.chat_template
    tok.chat_template = TEMPLATE
    try:
        args = {"city": "Paris", "n": [1, 2]}
        body = request(messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], tools=TOOLS)
        dicts = [m.as_template_dict(i) for i, m in enumerate(body.messages)]
        got = apply_chat_template(tok, dicts, tools=plan_tools(body, AUTO).tools)
        want = tok.apply_chat_template(
            [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
             {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}],
            tools=TOOLS, tokenize=False, add_generation_prompt=True)
    finally:
        tok.chat_template = old
    assert got == want
    assert "[call get_weather city=Paris" in got and "(for call_1)" in got and "<tools>get_weather;ping;" in got


def run(out: ChoiceOutput, pieces):
    deltas = [d for p in pieces for d in out.feed(p)] + out.finish()
    text = {"content": "", "reasoning_content": ""}
    calls = {}
    for d in deltas:
        for k in text:
            text[k] += d.get(k, "")
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": tc["function"].get("name"), "arguments": ""})
            c["arguments"] += tc["function"]["arguments"]
    return text, calls


def test_reasoning_then_hermes_pipeline(tokenizer):
    out_text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>')
    plan = plan_tools(request(tools=TOOLS), AUTO)
    msg = ChoiceOutput(plan, reasoning=True).message(out_text)
    assert msg["reasoning_content"] == "\nThe user wants weather.\n" and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    for pieces in (token_pieces(tokenizer, out_text), list(out_text)):
        text, calls = run(ChoiceOutput(plan, reasoning=True), pieces)
        assert text == {"content": "", "reasoning_content": msg["reasoning_content"]}
        assert calls == {0: {"name": "get_weather", "arguments": msg["tool_calls"][0]["function"]["arguments"]}}


def test_named_output_streams_as_arguments(tokenizer):
    plan = plan_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      AUTO)
    args = '{"city":"Lima"}'
    text, calls = run(ChoiceOutput(plan, reasoning=True), token_pieces(tokenizer, args))
    assert text == {"content": "", "reasoning_content": ""} and calls == {0: {"name": "get_weather",
                                                                              "arguments": args}}


@pytest.mark.parametrize("args,needles", [
    (["--tool-call-parser", "qwen"], ["--tool-call-parser", "'qwen'", "'hermes'", "'llama3_json'", "'gemma4'"]),
    (["--reasoning-parser", "r2"], ["--reasoning-parser", "'qwen3'", "'deepseek_r1'"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice needs --tool-call-parser"]),
])
def test_serve_flags_errors(args, needles):
    """An unknown parser name (the known ones listed) or auto tool choice without a parser: one error line,
    exit 2, before any model loads."""
    from tests.helpers import assert_cli_error, run_cli

    assert_cli_error(run_cli("serve", "--model-shape", "tiny", *args, timeout=60), *needles)
