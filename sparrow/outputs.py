"""Output types of ``LLM.generate``, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token: natural log, from the model's distribution before sampling
    transforms (temperature, penalties, truncation); ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request. ``text`` and ``token_ids`` are cumulative; ``delta_text`` and
    ``delta_token_ids`` are what the latest step added (what a stream sends). While a stop string may still
    complete, the text's last len(longest stop string) - 1 characters are held back from both."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or context) or None while running."""
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    """Sum of the generated tokens' logprobs (natural log, as ``logprobs`` holds them); None unless the request
    asked for logprobs (vLLM's)."""


@dataclass
class RequestMetrics:
    """When a request passed each stage (vLLM's ``RequestMetrics`` names): seconds of ``time.time()``, set by
    the engine. TTFT = first_token_time - arrival_time; decode tok/s = (tokens - 1) / (last_token_time -
    first_token_time)."""

    arrival_time: float
    """When ``add_request`` queued it."""
    first_token_time: float | None = None
    """When the step that produced its first output token finished."""
    last_token_time: float | None = None
    """When the step that produced its latest output token finished."""
    finished_time: float | None = None
    """When it finished (None while running)."""


@dataclass
class RequestOutput:
    """Everything generated for one prompt; ``metrics`` holds its timestamps (RequestMetrics); ``lora_request``: the
    LoRARequest it ran with (None: the base model)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    lora_request: object = None
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (vLLM's; of the first completion's prefill)."""
