"""Chat requests with ``tools``: what ``tool_choice`` asks of the model (vLLM's rules), and the assistant's
output turned into OpenAI's ``message`` / stream ``delta``s (``content``, ``tool_calls``, ``reasoning_content``).

- ``"none"`` (the default without tools): plain content; the tools still reach the chat template.
- ``"auto"`` (the default with tools): the model may call tools in its own format, read by the
  ``--tool-call-parser``; needs ``--enable-auto-tool-choice`` and a parser, else 400 (vLLM's message).
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained to the
  function's ``parameters`` schema and becomes that call's arguments.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one of the
  tools each (vLLM's schema; ``parallel_tool_calls: false`` allows one), each item a call.
A request that calls tools ends with finish_reason ``tool_calls`` (unless cut off: ``length``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from sparrow.server.reasoning import ReasoningStream
from sparrow.server.serving import ApiError
from sparrow.server.tool_parsers import ToolCallStream, ToolParser, get_tool_parser
from sparrow.server.tool_parsers.base import JsonCall, tool_call_id

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
"""vLLM's 400 message for tool_choice auto on a server started without them."""
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""The schema of a function declared without ``parameters``."""


@dataclass
class ToolPlan:
    """What a chat request's tools ask: ``mode`` one of none / auto / named / required."""

    mode: str
    tools: list[dict] | None
    """The tools as the chat template takes them (``[{"type": "function", "function": {...}}]``)."""
    parser: ToolParser | None = None
    name: str | None = None
    schema: dict | None = None
    """The JSON schema the output is constrained to (named / required)."""
    max_calls: int | None = None


def plan_tools(body, model) -> ToolPlan:
    """The ToolPlan of ``body`` (a ChatCompletionRequest) on a server whose ServedModel is ``model``. Raises
    ApiError 400 for tool_choice without tools, auto without --enable-auto-tool-choice / --tool-call-parser, a
    named function not in tools."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise ApiError(400, "tool_choice: needs tools (when using tool_choice, tools must be set)", "tool_choice")
    one = body.parallel_tool_calls is False
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not (model.enable_auto_tool_choice and model.tool_call_parser):
            raise ApiError(400, f"tool_choice: {AUTO_NEEDS_FLAGS}", "tool_choice")
        return ToolPlan("auto", tools, get_tool_parser(model.tool_call_parser), max_calls=1 if one else None)
    if choice == "required":
        items = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS},
                  "required": ["name", "parameters"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if one:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, _REQUIRED, schema=schema)
    name = choice.function.name
    fn = next((t["function"] for t in tools if t["function"]["name"] == name), None)
    if fn is None:
        raise ApiError(400, f"tool_choice: the function {name!r} is not in tools", "tool_choice")
    return ToolPlan("named", tools, name=name, schema=fn.get("parameters") or EMPTY_PARAMETERS)


class _ArrayMachine:
    """``tool_choice: "required"`` output: ``[{"name": ..., "parameters": {...}}, ...]`` (the schema makes it so)."""

    def __init__(self):
        self.buf, self.mode, self.call = "", "open", None

    def feed(self, text: str, final: bool) -> list:
        self.buf += text
        out: list = []
        while self.buf:
            head = self.buf.lstrip()
            if self.mode == "object" and self.call is not None:
                n, events = self.call.feed(self.buf)
                out += events
                self.buf = self.buf[n:]
                if not self.call.done:
                    return out
                self.call, self.mode = None, "between"
            elif not head:
                return out
            elif self.mode == "open" and head[0] == "[":
                self.buf, self.mode = head[1:], "object"
            elif self.mode == "object" and head[0] == "{":
                self.buf, self.call = head, JsonCall()
            elif self.mode == "between" and head[0] in ",]":
                self.buf, self.mode = head[1:], "object" if head[0] == "," else "closed"
            else:
                self.buf = ""  # not the schema's form (cut off or unconstrained): nothing more to read
        return out


class _RequiredParser(ToolParser):
    name = "required"

    def machine(self) -> _ArrayMachine:
        return _ArrayMachine()


_REQUIRED = _RequiredParser()


class ChoiceOutput:
    """One choice's generated text -> OpenAI deltas (``feed`` / ``finish``), or its whole ``message``.
    ``reasoning``: split ``<think>`` reasoning off first (``--reasoning-parser``); tool calls are read from the
    content after it."""

    def __init__(self, plan: ToolPlan | None, reasoning: bool):
        self.plan = plan
        mode = plan.mode if plan is not None else "none"
        # a named / required output is the schema's JSON from its first token: no reasoning to split off
        self.reasoning = ReasoningStream() if reasoning and mode not in ("named", "required") else None
        self.tools: ToolCallStream | None = plan.parser.stream(plan.max_calls) if mode in ("auto", "required") \
            else None
        self.named_id = tool_call_id() if mode == "named" else None
        self._named_started = False

    @property
    def called(self) -> bool:
        """Whether a tool call was emitted."""
        return self._named_started or (self.tools is not None and self.tools.called)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas for the next piece of generated text (``final``: the last piece, held text released)."""
        out: list[dict] = []
        if self.reasoning is not None:
            for kind, piece in self.reasoning.feed(text, final):
                if kind == "reasoning":
                    out.append({"reasoning_content": piece})
                else:
                    out += self._content(piece)
            if final:
                out += self._content("", final)
        else:
            out += self._content(text, final)
        return [d for d in out if d]

    def finish(self) -> list[dict]:
        return self.feed("", final=True)

    def _content(self, text: str, final: bool = False) -> list[dict]:
        if self.tools is not None:
            return self.tools.feed(text) + (self.tools.finish() if final else [])
        if self.named_id is None:
            return [{"content": text}] if text else []
        out = []
        if not self._named_started and (text or final):
            self._named_started = True
            out.append({"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                        "function": {"name": self.plan.name, "arguments": ""}}]})
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def message(self, text: str) -> dict:
        """The non-streaming ``message`` of a whole output: role, content, tool_calls (with tools),
        reasoning_content (with a reasoning parser)."""
        msg: dict = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            from sparrow.server.reasoning import extract_reasoning

            msg["reasoning_content"], content = extract_reasoning(text)
        calls: list[dict] = []
        mode = self.plan.mode if self.plan is not None else "none"
        if mode in ("auto", "required") and content is not None:
            content, calls = self.plan.parser.extract_tool_calls(content, self.plan.max_calls)
        elif mode == "named":
            calls = [{"id": self.named_id, "type": "function",
                      "function": {"name": self.plan.name, "arguments": content or ""}}]
            content = None
        msg["content"] = content
        if self.plan is not None and self.plan.tools:
            msg["tool_calls"] = calls
        return msg


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` for an output that called tools and stopped by itself; else ``reason``."""
    return "tool_calls" if called and reason == "stop" else reason


def template_arguments(arguments: str, where: str):
    """An assistant message's tool-call ``arguments`` (a JSON string, as OpenAI sends them) as the dict HF chat
    templates expect. Raises ApiError 400 naming ``where`` when it is not a JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object in a string", where)
    return value


def add_tool_args(parser) -> None:
    """``sparrow serve``'s tool and reasoning flags (vLLM's names); an unknown parser name is argparse's error
    listing the known ones."""
    from sparrow.server.reasoning import REASONING_PARSERS
    from sparrow.server.tool_parsers import TOOL_PARSERS

    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model call tools on its own (tool_choice "auto", the default with tools); '
                             "needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, metavar="NAME",
                        help="the model's tool-call format: " + ", ".join(sorted(TOOL_PARSERS)))
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None, metavar="NAME",
                        help="split <think> reasoning into reasoning_content: " + ", ".join(REASONING_PARSERS))


def chat_options(enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> dict:
    """The ServedModel fields of the tool and reasoning options, checked. Raises InvalidRequestError for an
    unknown parser name (naming the known ones) or auto tool choice without a parser."""
    from sparrow.errors import InvalidRequestError
    from sparrow.server.reasoning import check_reasoning_parser

    try:
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)
        if reasoning_parser is not None:
            check_reasoning_parser(reasoning_parser)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if enable_auto_tool_choice and tool_call_parser is None:
        raise InvalidRequestError("--enable-auto-tool-choice needs --tool-call-parser")
    return {"enable_auto_tool_choice": enable_auto_tool_choice, "tool_call_parser": tool_call_parser,
            "reasoning_parser": reasoning_parser}


async def constrain(plan: ToolPlan, params) -> None:
    """Set ``params`` (the request's SamplingParams) for ``plan``: the named / required schema as
    ``structured_outputs`` (built on a worker thread: the first one imports xgrammar), and
    ``skip_special_tokens`` off for a parser whose tags are special tokens. Raises ApiError 400 when the request
    constrains the output already (response_format, guided_*)."""
    import asyncio

    from sparrow.structured_outputs import StructuredOutputsParams

    if plan.schema is not None:
        if params.structured_outputs is not None:
            raise ApiError(400, f"tool_choice: {plan.mode} constrains the output to the tools' schema; leave out "
                                "response_format / guided_* / structured_outputs", "tool_choice")
        params.structured_outputs = await asyncio.to_thread(StructuredOutputsParams, json=plan.schema,
                                                            disable_any_whitespace=True)
    if plan.mode == "auto" and plan.parser.needs_special_tokens:
        params.skip_special_tokens = False


def stream_choices(outputs: list[ChoiceOutput] | None, d, logprobs, token_ids) -> list[dict]:
    """The stream chunks' ``choices`` items for one engine delta ``d`` of a choice (its text through that
    choice's ChoiceOutput when there is one): the first carries ``logprobs`` / ``token_ids``, the last the
    finish reason."""
    out = outputs[d.index] if outputs else None
    if out is None:
        deltas = [{"content": d.text}] if d.text else []
    else:
        deltas = out.feed(d.text) + (out.finish() if d.finish_reason is not None else [])
    reason = finish_reason(d.finish_reason, out is not None and out.called)
    if not deltas and reason is None and logprobs is None and not token_ids:
        return []
    items = []
    for k, delta in enumerate(deltas or [{}]):
        last = k == max(len(deltas), 1) - 1
        item = {"index": d.index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                "finish_reason": reason if last else None, "stop_reason": d.stop_reason if last else None}
        if token_ids is not None:
            item["token_ids"] = token_ids if k == 0 else []
        items.append(item)
    return items


def whole_choice(out: ChoiceOutput | None, c) -> dict:
    """A non-streaming choice's ``message`` and ``finish_reason`` (``c``: the accumulated ``serving.Choice``)."""
    if out is None:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    msg = out.message(c.text)
    return {"message": msg, "finish_reason": finish_reason(c.finish_reason, bool(msg.get("tool_calls")))}
