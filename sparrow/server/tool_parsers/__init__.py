"""Tool-call parsers by vLLM's ``--tool-call-parser`` names: each reads a model's tool-call format out of its
generated text, whole (``extract_tool_calls``) or streamed (``stream()``: OpenAI ``delta.tool_calls`` chunks)."""
from __future__ import annotations

from sparrow.server.tool_parsers.base import ToolCallStream, ToolParser
from sparrow.server.tool_parsers.gemma4 import Gemma4ToolParser
from sparrow.server.tool_parsers.hermes import HermesToolParser
from sparrow.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "gemma4": Gemma4ToolParser,
}
"""vLLM's parser names -> parser classes (``llama4_json`` is vLLM's alias of ``llama3_json``)."""


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``. Raises ValueError naming the known parsers for another name."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return cls()


__all__ = ["TOOL_PARSERS", "ToolCallStream", "ToolParser", "get_tool_parser"]
