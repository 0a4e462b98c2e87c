"""Request bodies of the OpenAI-compatible server (pydantic), with OpenAI's and vLLM's field names.

Ranges are declared on the fields, so a bad value is a 400 naming the field and its bound before anything
reaches the engine; ``sampling_params`` turns a request into sparrow's SamplingParams (which checks the rest).
Types are strict, as OpenAI's API reads them: a number field takes a JSON number (an integer field an integer),
a boolean field true / false; ``"2"``, ``true`` for a count, ``"yes"`` are 400s. A top-level field that is
neither declared, nor in ``UNSUPPORTED_FIELDS``, nor in ``IGNORED_FIELDS`` is unknown (``unknown_fields``): the
server answers 400 naming it (``sparrow serve --allow-unknown-fields``: logged and ignored, as vLLM does).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from sparrow.sampling_params import MAX_LOGPROBS, MAX_TOP_K, SamplingParams
from sparrow.server.structured import StructuredFields

TokenIds = list[StrictInt]
"""A prompt of token ids: JSON integers only (pydantic's lax int would read true / false / 1.0 as ids)."""


IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                            "safety_identifier", "request_id", "priority", "cache_salt"})
"""OpenAI / vLLM request fields that do not change the output (bookkeeping, routing): accepted and ignored."""

_STRICT = ConfigDict(strict=True, extra="ignore")


def unknown_fields(body: BaseModel) -> list[str]:
    """The fields of a request body (a model with ``extra="allow"``) that the server does not know, in order."""
    return [k for k in (body.model_extra or {}) if k not in UNSUPPORTED_FIELDS and k not in IGNORED_FIELDS]


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    """Send a last chunk with ``choices: []`` and the request's ``usage``."""


UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "logit_bias": (None, {}), "allowed_token_ids": (None, []), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,), "logits_processors": (None, []),
    "functions": (None, []), "function_call": (None, "none"),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
}
"""OpenAI / vLLM request fields that change the output and that this server does not implement -> the values
that leave the output unchanged (accepted); any other value is a 400 naming the field. Fields not listed and
not declared below (e.g. ``metadata``, ``store``) are ignored."""


class _Sampling(StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras; the
    structured-output fields in ``StructuredFields``)."""

    model_config = ConfigDict(strict=True, extra="allow")

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field this server does not implement that the request sets (see
        ``UNSUPPORTED_FIELDS``), or for stream_options without stream; None when there is none."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value not in UNSUPPORTED_FIELDS[name]:
                return name, f"{name}: not supported by this server (leave it out)"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options: only with stream=true"
        return None

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def _params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for ``max_tokens`` new tokens (OpenAI's defaults: temperature 1, top_p 1). Raises
        InvalidRequestError naming the field for a value SamplingParams refuses (e.g. min_tokens > max_tokens),
        ApiError 400 for a bad structured-output constraint."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (OpenAI's legacy completions)."""

    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False
    """vLLM's: each choice carries ``prompt_token_ids`` and ``token_ids`` (a stream: the prompt's in the choice's
    first chunk, each chunk's own generated ids); always on for a model without a tokenizer."""


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str
    """The arguments as a JSON object in a string (OpenAI's form)."""


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message."""

    model_config = _STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's tool calls."""
    tool_call_id: str | None = None
    """A ``tool`` message's answer to this call."""

    def as_template_dict(self, index: int = 0) -> dict:
        """{'role', 'content': str} for the chat template (text parts joined), with ``tool_calls`` (arguments
        as dicts, as HF templates expect) and ``tool_call_id`` when given. Raises ApiError 400 for tool-call
        arguments that are not a JSON object."""
        from sparrow.server.tool_choice import template_arguments

        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": template_arguments(
                    c.function.arguments, f"messages.{index}.tool_calls.{k}.function.arguments")}}
                for k, c in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ToolFunction(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    """The arguments' JSON schema."""
    strict: bool | None = None


class Tool(BaseModel):
    """A tool the model may call (OpenAI's ``tools`` item)."""

    model_config = _STRICT

    type: Literal["function"]
    function: ToolFunction


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call."""

    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: "auto" with tools, else "none" (``sparrow.server.tool_choice``)."""
    parallel_tool_calls: bool | None = None
    """False: at most one tool call."""
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False
    """vLLM's: the response carries ``prompt_token_ids`` (a stream: in its first chunk) and each choice (each
    chunk) its generated ``token_ids``."""


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids (JSON integers) -> text."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    tokens: TokenIds
