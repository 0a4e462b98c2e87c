"""SamplingParams: the per-request generation settings, with vLLM's field names and defaults."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

from sparrow.errors import InvalidRequestError
from sparrow.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Most log-probabilities returned per token (vLLM's default max_logprobs)."""
MAX_TOP_K = 2 ** 31 - 1
"""Largest top_k (the sampler holds it in an int tensor; any value >= the vocabulary keeps every token)."""


@dataclass
class SamplingParams:
    """How to sample one request. Field names and meanings follow vLLM's ``SamplingParams``.

    Raises InvalidRequestError (a ValueError) naming the field when a value is out of range.
    """

    n: int = 1
    """Number of completions to generate for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; in [0, 1]."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty (> 0) on tokens seen in the prompt or output: logits > 0 divided, < 0 multiplied."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated; in [-2, 2]."""
    seed: int | None = None
    """Seed of this request's own random generator (completion i uses seed + i). Its draws never depend on the
    batch, so the same seed gives the same tokens whatever the batch when the logits are the same: in fp32. In
    bf16 / fp16 the model's GEMMs and attention round differently with the batch's row count, so the logits
    can move by a rounding step and a sampled token at a near-tie can differ alone and inside a batch; the
    same seed, batch and dtype always repeat."""
    stop: str | list[str] | None = None
    """Strings that end generation; the stop string is not included in the output text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to EOS)."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens were generated."""
    logprobs: int | None = None
    """Return the log-probabilities of this many most likely tokens (plus the sampled one) per step."""
    prompt_logprobs: int | None = None
    """Return this many log-probabilities per prompt token."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice list or grammar (xgrammar's token bitmask applied in the
    sampler); the sequence finishes with finish_reason "stop" when the grammar is complete."""
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
            return v

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            number(name)
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K} (one at or "
                               "above the vocabulary size keeps every token)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad("stop", "must be a string, a list of strings or None")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise bad("stop", "stop strings must be non-empty strings")
        self._stop_list = stop
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of integers or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalized to a list."""
        return self._stop_list
