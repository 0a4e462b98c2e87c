"""Tool calling and the reasoning parser over HTTP with the official ``openai`` client, on the packaged
SmolLM2-135M-Instruct (its chat template has no tool support: the prompt renders without the tools, as
transformers does) served with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``.

- tool_choice named / required: the output is constrained by the function's schema (vLLM's schemas); the
  arguments must validate against the function's ``parameters`` (jsonschema is the oracle);
- tool_choice auto: the real engine's output is forced into a ``<think>`` block and a Hermes ``<tool_call>``
  block by guided_regex (the simplest honest way to get a tool call from a 135M model); the hermes and reasoning
  parsers read it, streamed token by token and whole;
- the 400s (vLLM's rules), and assistant ``tool_calls`` / ``tool`` messages reaching the chat template.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers import smollm2_gguf
from tests.server.conftest import API_KEY, MODEL_NAME, start_server, stop_server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "tomorrow"],
           "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "tomorrow": {"type": "boolean"}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = (r'<think>[a-z ]{1,12}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "(Paris|Tokyo)", "unit": "celsius", "tomorrow": (true|false)\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def served():
    from sparrow import LLM

    llm = LLM(str(smollm2_gguf()), device="cpu", dtype="float32", max_model_len=512)
    running = start_server(llm, served_model_name=MODEL_NAME, api_key=API_KEY,
                           chat={"enable_auto_tool_choice": True, "tool_call_parser": "hermes",
                                 "reasoning_parser": "qwen3"})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0)


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        if names is not None:
            assert c.function.name in names


def collect_stream(stream):
    """(content, reasoning, {index: [id, name, arguments]}, finish_reason) of a chat stream, checking each
    tool call's first chunk carries id, type and name, later ones only argument fragments."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][2] += tc.function.arguments
        finish = ch.finish_reason or finish
    return content, reasoning, calls, finish


def test_named_tool_choice(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, temperature=0)
    m = r.choices[0].message
    check_calls(m.tool_calls, {"get_weather"})
    assert len(m.tool_calls) == 1 and not m.content and r.choices[0].finish_reason == "tool_calls"
    s = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, temperature=0, stream=True)
    content, _, calls, finish = collect_stream(s)
    assert not content and finish == "tool_calls" and list(calls) == [0]
    assert calls[0][1:] == ["get_weather", m.tool_calls[0].function.arguments]


def test_required_tool_choice(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0)
    m = r.choices[0].message
    check_calls(m.tool_calls, set(SCHEMAS))
    assert r.choices[0].finish_reason == "tool_calls"
    s = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0, stream=True)
    _, _, calls, finish = collect_stream(s)
    assert finish == "tool_calls"
    assert [c[1:] for c in calls.values()] == [[c.function.name, c.function.arguments] for c in m.tool_calls]


def test_auto_hermes_and_reasoning_streamed_token_by_token(client):
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
              extra_body={"guided_regex": FORCED})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    check_calls(m.tool_calls, {"get_weather"})
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and m.content is None
    assert r.choices[0].finish_reason == "tool_calls"
    content, s_reasoning, calls, finish = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert (content, s_reasoning, finish) == ("", reasoning, "tool_calls")
    assert [c[1:] for c in calls.values()] == [["get_weather", m.tool_calls[0].function.arguments]]


def test_auto_plain_answer_is_content(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=30, temperature=0,
                                       extra_body={"guided_regex": r"<think>hm</think>It is (sunny|rainy)\."})
    m = r.choices[0].message
    assert m.tool_calls == [] or m.tool_calls is None
    assert m.content in ("It is sunny.", "It is rainy.") and r.choices[0].finish_reason == "stop"


def test_tool_messages_render(client, served):
    """A conversation with an assistant tool call and the tool's answer is accepted (SmolLM2's template shows
    the contents); arguments that are not a JSON object are a 400 naming the field."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris"}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason in ("stop", "length")
    bad = [*msgs[:1], {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=bad, max_tokens=4)
    assert e.value.body["param"] == "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize("kw,param,needle", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope' is not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
])
def test_tool_request_errors(client, kw, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param and needle in e.value.body["message"]


def test_auto_without_the_flag_is_vllms_400(tiny_server):
    c = openai.OpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=4)
    assert e.value.body["message"] == ('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                       '--tool-call-parser to be set')  # vLLM's message, after the field
    r = c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls == []
