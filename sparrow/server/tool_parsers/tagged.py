"""The machine for formats that wrap each call in a start and an end tag around a body (Hermes' ``<tool_call>``
JSON ``</tool_call>``, Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>``): text outside the tags is content,
a body that is not a well-formed call (found out before its name was emitted) goes back to the content with its
tags."""
from __future__ import annotations

from sparrow.server.tool_parsers.base import held_prefix

_WS = " \t\n\r"


class TaggedMachine:
    """``start`` / ``end``: the tags; ``new_call()``: a body parser with ``feed(text) -> (consumed, events)``,
    ``done``, ``failed`` and ``named`` (as ``base.JsonCall``). After the body, whitespace then ``end`` close the
    call; anything else ends it too (the model forgot the tag) and is read as content."""

    def __init__(self, start: str, end: str, new_call):
        self.start, self.end, self.new_call = start, end, new_call
        self.buf = ""
        self.mode = "text"
        self.call = None
        self.raw = ""

    def feed(self, text: str, final: bool) -> list:
        self.buf += text
        out: list = []
        while True:
            if self.mode == "text":
                i = self.buf.find(self.start)
                if i < 0:
                    keep = 0 if final else held_prefix(self.buf, self.start)
                    if len(self.buf) > keep:
                        out.append(("text", self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if i:
                    out.append(("text", self.buf[:i]))
                self.buf = self.buf[i + len(self.start):]
                self.mode, self.call, self.raw = "body", self.new_call(), self.start
            elif self.mode == "body":
                n, events = self.call.feed(self.buf)
                self.raw += self.buf[:n]
                self.buf = self.buf[n:]
                out += events
                if self.call.failed or (final and not self.call.done and not self.call.named):
                    out.append(("text", self.raw))  # not a call: its text is content
                    self.mode = "text"
                elif self.call.done:
                    self.mode = "after"
                elif final:
                    self.mode = "text"  # cut off inside the call: the call ends where the output does
                else:
                    return out
            else:  # after the body: whitespace, then the end tag
                stripped = self.buf.lstrip(_WS)
                if stripped.startswith(self.end):
                    self.buf = stripped[len(self.end):]
                    self.mode = "text"
                elif not final and self.end.startswith(stripped):
                    return out
                else:
                    self.mode = "text"
