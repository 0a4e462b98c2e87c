"""What every tool-call parser shares: the events a format's machine produces, the stream that turns them into
OpenAI ``delta`` dicts (``content``, or ``tool_calls`` with index, id, type, function name first, then argument
fragments), the non-streaming extraction built on the same machine, and a sub-machine for a call written as one
JSON object (``{"name": ..., "arguments": {...}}``, Hermes' and Llama 3's form).

A format's machine (``ToolParser.machine()``) has ``feed(text, final) -> list[event]``, where an event is
``("text", str)`` (content), ``("name", str)`` (a new call's function name) or ``("args", str)`` (the current
call's next argument characters). ``final`` marks the end of the output: what was held back (a possible start of
a tag) is released. The machine's events depend only on the text, not on how it was split, so the streamed
fragments of a call concatenate to exactly the arguments the non-streaming extraction returns.
"""
from __future__ import annotations

import json
import uuid

from sparrow.server.tool_parsers.json_scan import JsonObjectScanner

ARGUMENT_KEYS = ("arguments", "parameters")
"""Keys of a JSON tool call's arguments, in the order looked for (Llama 3 writes ``parameters``)."""


def tool_call_id() -> str:
    """A tool call's id in vLLM's form (``chatcmpl-tool-`` and 32 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest proper prefix of ``tag`` that ``text`` ends with (0 when none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class JsonCall:
    """One tool call written as a JSON object with a ``name`` string and an ``arguments`` (or ``parameters``)
    object; feed text with ``feed``. Events: ("name", name) once the name string closed, then ("args", raw
    characters of the arguments value) as they arrive (a string value holding JSON: its decoded text once it
    closed; no arguments: "{}" when the object closes). ``failed``: the text is not such a call (nothing emitted
    yet) -- its ``raw`` text then belongs to the content; an error after the name was emitted ends the call."""

    def __init__(self):
        self.scan = JsonObjectScanner()
        self.body = ""
        self.named = False
        self.sent = 0
        self.failed = False

    @property
    def done(self) -> bool:
        return self.scan.done or self.scan.error or self.failed

    def feed(self, text: str) -> tuple[int, list]:
        """Consume what belongs to the object; returns (characters consumed, events)."""
        n = self.scan.feed(text)
        self.body += text[:n]
        out: list = []
        if self.scan.error:
            self.failed = not self.named
            return n, out
        f = self.scan.fields
        if not self.named and "name" in f and f["name"][1] is not None:
            name = json.loads(self.body[f["name"][0]:f["name"][1]])
            if not isinstance(name, str) or not name:
                self.failed = True
                return n, out
            self.named = True
            out.append(("name", name))
        if self.named:
            out += self._args(f)
        if self.scan.done and not self.named:
            self.failed = True
        return n, out

    def _args(self, f: dict) -> list:
        key = next((k for k in ARGUMENT_KEYS if k in f), None)
        if key is None:
            if self.scan.done and self.sent == 0:
                self.sent = 2
                return [("args", "{}")]
            return []
        start, end = f[key]
        first = self.body[start]
        if first == "{":
            stop = len(self.body) if end is None else end
            frag = self.body[start + self.sent:stop]
            self.sent += len(frag)
            return [("args", frag)] if frag else []
        if first == '"' and end is not None and self.sent == 0:  # arguments given as a JSON string
            self.sent = 1
            return [("args", json.loads(self.body[start:end]))]
        return []


class ToolCallStream:
    """Turns a format machine's events into OpenAI chat ``delta`` dicts, one ``feed`` per text delta.

    Content that is only whitespace is held until other content arrives (a model's newlines around its tool
    calls are no answer); at ``finish`` it is dropped when a tool was called. ``max_calls``: calls past this
    many are dropped (``parallel_tool_calls: false`` keeps one).
    """

    def __init__(self, parser: "ToolParser", max_calls: int | None = None):
        self.machine = parser.machine()
        self.max_calls = max_calls
        self.calls: list[dict] = []  # {"id", "name", "arguments"}
        self._held = ""
        self._content_started = False

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict]:
        """The deltas (``{"content": ...}`` / ``{"tool_calls": [...]}``) for the next piece of generated text."""
        return self._deltas(self.machine.feed(text, False))

    def finish(self) -> list[dict]:
        """The deltas for what was held back, at the end of the output."""
        out = self._deltas(self.machine.feed("", True))
        if self._held and not self.calls:
            out.append({"content": self._held})
            self._held = ""
        return out

    def _deltas(self, events: list) -> list[dict]:
        out: list[dict] = []
        for kind, value in events:
            if kind == "text":
                self._content(value, out)
            elif kind == "name":
                self.calls.append({"id": tool_call_id(), "name": value, "arguments": ""})
                if self._keep(len(self.calls) - 1):
                    out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": self.calls[-1]["id"],
                                                "type": "function",
                                                "function": {"name": value, "arguments": ""}}]})
            elif value:  # args
                call = self.calls[-1]
                call["arguments"] += value
                idx = len(self.calls) - 1
                if not self._keep(idx):
                    continue
                last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
                if last is not None and last["index"] == idx and "id" not in last:  # the name's chunk stays apart
                    last["function"]["arguments"] += value
                else:
                    out.append({"tool_calls": [{"index": idx, "function": {"arguments": value}}]})
        return out

    def _keep(self, idx: int) -> bool:
        return self.max_calls is None or idx < self.max_calls

    def _content(self, text: str, out: list) -> None:
        if not text:
            return
        if not self._content_started:
            self._held += text
            if not self._held.strip():
                return
            text, self._held = self._held, ""
            self._content_started = True
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})


class ToolParser:
    """A tool-call format; subclasses set ``name`` (vLLM's ``--tool-call-parser`` name) and ``machine``."""

    name = ""
    needs_special_tokens = False
    """Its tags are special tokens: decode with ``skip_special_tokens=False`` while tools may be called."""

    def machine(self):
        raise NotImplementedError

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        """A streaming parser for one output (one choice)."""
        return ToolCallStream(self, max_calls)

    def extract_tool_calls(self, text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole output. ``tool_calls``: OpenAI's ``[{"id", "type": "function",
        "function": {"name", "arguments": JSON text}}]``; content None when the output held only tool calls and
        whitespace. An output with no well-formed call -- or with a call whose arguments are not a JSON object
        -- is all content: ``(text, [])``."""
        s = self.stream(max_calls)
        content = "".join(d.get("content", "") for d in s.feed(text) + s.finish())
        calls = s.calls[:max_calls] if max_calls is not None else s.calls
        if not calls:
            return text, []
        for c in calls:
            try:
                if not isinstance(json.loads(c["arguments"]), dict):
                    return text, []
            except ValueError:
                return text, []
        return content or None, [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
