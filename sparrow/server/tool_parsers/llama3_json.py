"""``llama3_json`` (vLLM's name; also ``llama4_json``): Llama 3.1 / 3.2 / 3.3 answer a tool call with the whole
output as JSON, ``{"name": "get_weather", "parameters": {"city": "Paris"}}``, optionally after
``<|python_tag|>``, several calls separated by ``;``. An output that does not start (after whitespace) with ``{`` or
``<|python_tag|>`` is content; so is a first object that is not a call."""
from __future__ import annotations

from sparrow.server.tool_parsers.base import JsonCall, ToolParser

PYTHON_TAG = "<|python_tag|>"
_WS = " \t\n\r"


class _Llama3Machine:
    def __init__(self):
        self.buf = ""
        self.mode = "start"
        self.call: JsonCall | None = None
        self.raw = ""

    def feed(self, text: str, final: bool) -> list:
        self.buf += text
        out: list = []
        while True:
            if self.mode == "start":
                head = self.buf.lstrip(_WS)
                if head.startswith(PYTHON_TAG):
                    self.raw, self.buf = self.buf[:len(self.buf) - len(head) + len(PYTHON_TAG)], \
                        head[len(PYTHON_TAG):]
                    self.mode = "object"
                elif head.startswith("{"):
                    self.raw, self.buf, self.mode = self.buf[:len(self.buf) - len(head)], head, "object"
                elif not final and (not head or PYTHON_TAG.startswith(head)):
                    return out
                else:
                    self.mode = "text"
            elif self.mode == "text":
                if self.buf:
                    out.append(("text", self.buf))
                    self.buf = ""
                return out
            elif self.mode == "object":
                if self.call is None:
                    head = self.buf.lstrip(_WS)
                    if not head and not final:
                        return out
                    self.raw += self.buf[:len(self.buf) - len(head)]
                    self.buf, self.call = head, JsonCall()
                n, events = self.call.feed(self.buf)
                self.raw += self.buf[:n]
                self.buf = self.buf[n:]
                out += events
                if self.call.failed or (final and not self.call.done and not self.call.named):
                    out.append(("text", self.raw))  # not a call: everything so far is content
                    self.mode = "text"
                elif self.call.done:
                    self.mode, self.raw = "separator", ""
                elif final:
                    self.mode = "text"
                else:
                    return out
            else:  # between calls: whitespace, then ';' (or the next object's '{'), else content
                head = self.buf.lstrip(_WS)
                if not head and not final:
                    return out
                if head.startswith(";"):
                    self.buf, self.call, self.mode = head[1:], None, "object"
                elif head.startswith("{"):
                    self.buf, self.call, self.mode = head, None, "object"
                else:
                    self.buf = self.buf if head else ""
                    self.mode = "text"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def machine(self) -> _Llama3Machine:
        return _Llama3Machine()
