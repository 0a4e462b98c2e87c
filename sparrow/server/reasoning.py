"""``--reasoning-parser`` (vLLM's names ``qwen3`` and ``deepseek_r1``): the text a model writes before ``</think>``
is its reasoning (``reasoning_content``), the text after it the answer (``content``); a ``<think>`` tag in the
output is dropped (these models' chat templates often put it in the prompt). Without ``</think>`` the whole
output is reasoning (the model was cut off while thinking), as vLLM's parsers answer."""
from __future__ import annotations

from sparrow.server.tool_parsers.base import held_prefix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""vLLM's names of the ``<think>`` parsers this server has."""


def check_reasoning_parser(name: str) -> str:
    """``name`` when it is a known reasoning parser; raises ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(REASONING_PARSERS)})")
    return name


class ReasoningStream:
    """Splits one output, fed piece by piece, into ("reasoning", text) and ("content", text) events; a possible
    start of a tag at the end of a piece is held until the next one (or ``final``)."""

    def __init__(self):
        self.buf = ""
        self.thinking = True
        self.started = False

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        if not self.thinking:
            out, self.buf = self.buf, ""
            return [("content", out)] if out else []
        out: list[tuple[str, str]] = []
        if not self.started:
            i = self.buf.find(START)
            if i >= 0 and (self.buf.find(END) < 0 or i < self.buf.find(END)):
                if i:
                    out.append(("reasoning", self.buf[:i]))
                self.buf, self.started = self.buf[i + len(START):], True
        j = self.buf.find(END)
        if j >= 0:
            if j:
                out.append(("reasoning", self.buf[:j]))
            rest, self.buf, self.thinking = self.buf[j + len(END):], "", False
            if rest:
                out.append(("content", rest))
            return out
        keep = 0 if final else max(held_prefix(self.buf, END), 0 if self.started else held_prefix(self.buf, START))
        if len(self.buf) > keep:
            out.append(("reasoning", self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
        return out


def extract_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; each None when empty."""
    parts = {"reasoning": "", "content": ""}
    for kind, piece in ReasoningStream().feed(text, final=True):
        parts[kind] += piece
    return parts["reasoning"] or None, parts["content"] or None
