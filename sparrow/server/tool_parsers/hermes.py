"""``hermes`` (vLLM's name): Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as
``<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>``; text outside the tags is
content. Qwen's tokenizers keep ``<tool_call>`` as an added (not special) token, so the default
``skip_special_tokens`` leaves it in the text."""
from __future__ import annotations

from sparrow.server.tool_parsers.base import JsonCall, ToolParser
from sparrow.server.tool_parsers.tagged import TaggedMachine

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def machine(self) -> TaggedMachine:
        return TaggedMachine(START, END, JsonCall)
