"""``gemma4`` (vLLM's name, for Gemma 4): each call is ``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``, where
strings are delimited by ``<|"|>``, keys are bare (or delimited), and numbers, ``true`` / ``false`` / ``null``,
``{...}`` and ``[...]`` are written as in JSON; calls follow each other without separators. The arguments are
translated to JSON text character by character as they arrive (bare values once complete). The tags are special
tokens: the server decodes with ``skip_special_tokens=False`` while tools may be called."""
from __future__ import annotations

import json
import re

from sparrow.server.tool_parsers.base import ToolParser, held_prefix
from sparrow.server.tool_parsers.tagged import TaggedMachine

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = re.compile(r"[\w\-.]")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_WS = " \t\n\r"


def _bare(value: str) -> str:
    """A bare value as JSON text: a JSON number or literal as it is (``none`` / ``nil`` as null), else a string."""
    v = value.strip()
    if v in ("true", "false", "null") or _NUMBER.fullmatch(v):
        return v
    if v.lower() in ("none", "nil", "null"):
        return "null"
    try:
        return json.dumps(float(v))
    except ValueError:
        return json.dumps(v, ensure_ascii=False)


class _Gemma4Call:
    """The body after ``<|tool_call>``: ``call:``, the name up to ``{``, then the arguments object."""

    def __init__(self):
        self.phase = "prefix"
        self.name = ""
        self.named = False
        self.failed = False
        self.finished = False
        self.stack: list[str] = []
        self.state = ""
        self.item = False  # the current container has an item (a comma comes before the next)
        self.acc = ""

    @property
    def done(self) -> bool:
        return self.finished or self.failed

    def feed(self, text: str) -> tuple[int, list]:
        out: list = []
        i = 0
        while i < len(text) and not self.done:
            if self.phase == "prefix":
                want = "call:"[len(self.acc):]
                got = text[i:i + len(want)]
                if not want.startswith(got):
                    self.failed = True
                    break
                self.acc += got
                i += len(got)
                if self.acc == "call:":
                    self.phase, self.acc = "name", ""
            elif self.phase == "name":
                ch = text[i]
                if ch == "{" and self.name:
                    self.named, self.phase = True, "args"
                    self.stack, self.state, self.item = ["{"], "key", False
                    out += [("name", self.name), ("args", "{")]
                    i += 1
                elif _NAME.match(ch):
                    self.name += ch
                    i += 1
                else:
                    self.failed = True
            else:
                n, frag = self._args(text[i:])
                if frag:
                    out.append(("args", frag))
                if n == 0:
                    break
                i += n
        return i, out

    def _args(self, text: str) -> tuple[int, str]:  # noqa: C901  (one switch over the states)
        """Translate a run of argument characters; returns (consumed, JSON text). Consumes nothing when it
        needs more text (a possible ``<|"|>`` or an unfinished bare value or key at the end)."""
        out, i = [], 0
        while i < len(text) and not self.finished:
            rest, ch = text[i:], text[i]
            if self.state == "string":
                j = rest.find(QUOTE)
                if j < 0:
                    j = len(rest) - held_prefix(rest, QUOTE)
                    out.append(json.dumps(rest[:j], ensure_ascii=False)[1:-1])
                    i += j
                    break
                out.append(json.dumps(rest[:j], ensure_ascii=False)[1:-1] + '"')
                i += j + len(QUOTE)
                self.state = "after"
                continue
            if len(rest) < len(QUOTE) and QUOTE.startswith(rest):
                break  # wait: maybe a delimiter
            if self.state == "key":
                if ch in _WS + ",":
                    i += 1
                elif ch == "}":
                    out.append(self._close("}"))
                    i += 1
                else:
                    j = rest.find(":")
                    if j < 0:
                        break  # the key is not complete yet
                    key = rest[:j].strip()
                    if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
                        key = key[len(QUOTE):-len(QUOTE)]
                    out.append(("," if self.item else "") + json.dumps(key, ensure_ascii=False) + ":")
                    self.item, self.state = True, "value"
                    i += j + 1
            elif self.state in ("value", "array"):
                if ch in _WS or (self.state == "array" and ch == ","):
                    i += 1
                    continue
                if self.state == "array" and ch == "]":
                    out.append(self._close("]"))
                    i += 1
                    continue
                comma = "," if self.state == "array" and self.item else ""
                if rest.startswith(QUOTE) or ch in "{[" or any(c in ",}]" for c in rest):
                    self.item = self.item or self.state == "array"  # the value starts now
                if rest.startswith(QUOTE):
                    out.append(comma + '"')
                    self.state = "string"
                    i += len(QUOTE)
                elif ch in "{[":
                    out.append(comma + ch)
                    self.stack.append(ch)
                    self.state, self.item = ("key" if ch == "{" else "array"), False
                    i += 1
                else:
                    j = next((k for k, c in enumerate(rest) if c in ",}]"), -1)
                    if j < 0:
                        break  # the bare value may go on
                    out.append(comma + _bare(rest[:j]))
                    self.state = "after"
                    i += j
            else:  # after a value
                if ch in _WS:
                    i += 1
                elif ch == ",":
                    self.state = "key" if self.stack[-1] == "{" else "array"
                    i += 1
                elif ch in "}]":
                    out.append(self._close(ch))
                    i += 1
                else:
                    self.finished = True  # not the format: the call ends here (its arguments are cut)
                    break
        return i, "".join(out)

    def _close(self, ch: str) -> str:
        if not self.stack or self.stack[-1] != ("{" if ch == "}" else "["):
            self.finished = True  # a mismatched bracket: the call ends here (its arguments are cut)
            return ""
        self.stack.pop()
        if not self.stack:
            self.finished = True
        else:
            self.state, self.item = "after", True
        return ch


class Gemma4ToolParser(ToolParser):
    name = "gemma4"
    needs_special_tokens = True

    def machine(self) -> TaggedMachine:
        return TaggedMachine(START, END, _Gemma4Call)
