"""Response bodies of /v1/completions and /v1/chat/completions (OpenAI's layouts) built from the engine loop's
updates: choices, legacy and chat logprobs, usage, stream chunks.

One ``Choice`` accumulates a completion; ``completion_logprobs`` / ``chat_logprobs`` render a run of tokens'
logprobs in the two layouts OpenAI defines (legacy: parallel lists tokens / token_logprobs / top_logprobs /
text_offset; chat: a list of {token, logprob, bytes, top_logprobs}).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from sparrow.outputs import Logprob


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """The request's max_tokens (None: what the context leaves). Raises ApiError 400 naming both numbers when
    prompt + max_tokens does not fit in max_model_len."""
    if num_prompt >= max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{num_prompt} tokens (at most {max_model_len - 1} leave room for one generated token)",
                       param)
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{num_prompt} tokens and max_tokens asks for {max_tokens} more "
                            f"({num_prompt + max_tokens} in all)", "max_tokens")
    return max_tokens


def _top(d: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= k),
                  key=lambda x: x[1].rank)[:k]


def _token_str(lp: Logprob, tid: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"


@dataclass
class LegacyLogprobs:
    """OpenAI's completions ``logprobs`` object, accumulated token by token."""

    k: int
    decode: Callable[[int], str]
    """A token's text when no Logprob carries it (the prompt's first token)."""
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, tid: int, d: dict[int, Logprob] | None) -> None:
        """One token; ``d`` None: the prompt's first token (nothing predicts it)."""
        lp = d.get(tid) if d is not None else None
        s = _token_str(lp, tid) if lp is not None else self.decode(tid)
        self.tokens.append(s)
        self.token_logprobs.append(lp.logprob if lp is not None else None)
        top = None
        if d is not None:  # keyed by text (the legacy layout): tokens that render alike keep the likeliest
            top = {}
            for t, v in _top(d, self.k):
                top.setdefault(_token_str(v, t), v.logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(s)

    def body(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        """The body so far, then start over (a stream chunk carries only its own tokens)."""
        out = self.body()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> dict:
    """OpenAI's chat ``logprobs`` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(t: int, lp: Logprob) -> dict:
        s = _token_str(lp, t)
        return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, d in zip(token_ids, lps):
        e = entry(tid, d[tid])
        e["top_logprobs"] = [entry(t, lp) for t, lp in _top(d, k)]
        content.append(e)
    return {"content": content}


@dataclass
class Choice:
    """One completion being accumulated (non-stream answers)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
