"""An incremental JSON syntax checker for one top-level object, fed text piece by piece, that records where each
top-level key's value starts and ends (so a parser can stream one value's raw text as it arrives).

The checker follows RFC 8259's grammar: strings with escapes (``\\uXXXX`` included), numbers, ``true`` /
``false`` / ``null``, nested objects and arrays. It stops at the first character after the object closes, and
at the first syntax error (``error`` set; the offending character is not consumed). The result depends only on
the text, never on how it was split into pieces.
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_LITERAL_CHARS = frozenset("0123456789+-.eEtruefalsn")
_WS = " \t\n\r"


class JsonObjectScanner:
    """Feed with ``feed(text)``; read ``done``, ``error``, ``fields`` and ``pos``.

    ``fields``: top-level key -> [start, end] offsets (in the text fed so far, from its first character) of the
    key's raw value; ``end`` is None while the value is incomplete. ``pos``: characters consumed.
    """

    def __init__(self):
        self.stack: list[str] = []
        self.state = "start"
        self.pos = 0
        self.done = False
        self.error = False
        self.fields: dict[str, list] = {}
        self._key = ""
        self._top_key = ""
        self._is_key = False
        self._lit = ""
        self._uni = 0

    def feed(self, text: str) -> int:
        """Consume characters of ``text`` until the object closes or an error; returns how many it consumed."""
        n = 0
        for ch in text:
            if self.done or self.error:
                break
            if not self._step(ch):
                self.error = True
                break
            self.pos += 1
            n += 1
        return n

    # one character: False on a syntax error
    def _step(self, ch: str) -> bool:  # noqa: C901  (a state machine reads best as one switch)
        s = self.state
        if s == "string":
            if ch == "\\":
                self.state = "escape"
            elif ch == '"':
                self._end_string()
            elif ch < " ":
                return False
            elif self._is_key:
                self._key += ch
            return True
        if s == "escape":
            if ch == "u":
                self.state, self._uni = "unicode", 4
            elif ch in '"\\/bfnrt':
                if self._is_key:
                    self._key += {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}.get(ch, ch)
                self.state = "string"
            else:
                return False
            return True
        if s == "unicode":
            if ch not in "0123456789abcdefABCDEF":
                return False
            self._uni -= 1
            if self._uni == 0:
                self.state = "string"
            return True
        if s == "literal":
            if ch in _LITERAL_CHARS:
                self._lit += ch
                return True
            if not (_NUMBER.fullmatch(self._lit) or self._lit in ("true", "false", "null")):
                return False
            self._close_value(self.pos)
            return self._step(ch)  # the terminator, in the state after the value
        if ch in _WS:
            return True
        if s == "start":
            if ch != "{":
                return False
            self.stack.append("{")
            self.state = "obj_first"
            return True
        if s in ("obj_first", "obj_key"):
            if ch == '"':
                self.state, self._is_key, self._key = "string", True, ""
                return True
            if ch == "}" and s == "obj_first":
                return self._close_container("{")
            return False
        if s == "colon":
            if ch != ":":
                return False
            self.state = "value"
            return True
        if s == "arr_first" and ch == "]":
            return self._close_container("[")
        if s in ("value", "arr_first"):
            return self._start_value(ch)
        if s == "after":
            if ch == ",":
                self.state = "obj_key" if self.stack[-1] == "{" else "value"
                return True
            if ch in "}]":
                return self._close_container("{" if ch == "}" else "[")
        return False

    def _start_value(self, ch: str) -> bool:
        if len(self.stack) == 1:
            self.fields[self._top_key] = [self.pos, None]
        if ch in "{[":
            self.stack.append(ch)
            self.state = "obj_first" if ch == "{" else "arr_first"
        elif ch == '"':
            self.state, self._is_key = "string", False
        elif ch in "-0123456789tfn":
            self.state, self._lit = "literal", ch
        else:
            return False
        return True

    def _end_string(self) -> None:
        if self._is_key:
            self._is_key = False
            if len(self.stack) == 1:
                self._top_key = self._key
            self.state = "colon"
        else:
            self._close_value(self.pos + 1)

    def _close_container(self, kind: str) -> bool:
        if not self.stack or self.stack[-1] != kind:
            return False
        self.stack.pop()
        self._close_value(self.pos + 1, container=True)
        return True

    def _close_value(self, end: int, container: bool = False) -> None:
        """A value ended at ``end`` (exclusive); a container's own close has popped it already."""
        depth = len(self.stack)
        if depth == 0:
            self.done = True
            return
        if depth == 1 and self.stack[0] == "{":
            self.fields[self._top_key][1] = end
        self.state = "after"
