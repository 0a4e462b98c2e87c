"""The messages between the HTTP front end and the engine process (one multiprocessing pipe, pickled).

Front end -> engine: ``AddRequest``, ``AbortRequest``, ``LoadLoRA``, ``UnloadLoRA`` (read by ``EngineLoop.pump``),
``FrontendReady`` (once, when the front end listens). Engine -> front end: ``Baseline`` (once, before the loop),
``StepOutputs`` (one per engine-loop iteration, whatever the number of requests), ``LoRAAnswer`` (one per
runtime LoRA message), ``StopFrontend``. The items of a ``StepOutputs`` are (request_id, item) pairs in order,
item being ``Admitted``, ``Update``, ``StreamError`` or None (the request ended).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sparrow.outputs import Logprob
from sparrow.sampling_params import SamplingParams


@dataclass(slots=True)
class Delta:
    """What one step added to one completion."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class Update:
    """One step's deltas of one request (a copy: the engine's RequestOutput objects change on the next step)."""

    deltas: list[Delta]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """The prompt's logprobs, with the request's first tokens only."""


@dataclass(slots=True)
class StreamError:
    message: str
    invalid_request: bool
    """True: the request's fault (a 400); False: the engine failed (a 500, no detail leaks)."""


@dataclass(slots=True)
class Admitted:
    time: float
    """time.monotonic() when the engine took the request in (CLOCK_MONOTONIC: one clock for both processes)."""


@dataclass(slots=True)
class EngineState:
    """The engine's gauges and cumulative counts after a loop iteration (what /metrics shows)."""

    running: int
    waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec: tuple[int, ...] | None
    """(drafts, draft tokens, accepted tokens, accepted per position...), None without speculation."""
    step: tuple[str, float] | None = None
    """The engine step of this iteration: ("prefill" (it computed prompt tokens) or "decode", wall seconds)."""
    lora: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """The LoRA adapter names (``lora_name``) of the running and of the waiting sequences, each name once, in queue
    order; None: the engine runs without LoRA."""


def merge_updates(a: Update, b: Update) -> Update:
    """One Update carrying ``a``'s then ``b``'s deltas (two steps of one request, coalesced when the front end
    reads them together): per completion index, text and tokens concatenated, the later finish reason."""
    by_index = {d.index: Delta(d.index, d.text, list(d.token_ids), None if d.logprobs is None else list(d.logprobs),
                               d.finish_reason, d.stop_reason) for d in a.deltas}
    for d in b.deltas:
        m = by_index.get(d.index)
        if m is None:
            by_index[d.index] = d
            continue
        m.text += d.text
        m.token_ids += d.token_ids
        if d.logprobs is not None:
            m.logprobs = (m.logprobs or []) + d.logprobs
        if d.finish_reason is not None:
            m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
    return Update(list(by_index.values()), b.finished,
                  b.prompt_logprobs if b.prompt_logprobs is not None else a.prompt_logprobs)


# ------------------------------------------------------------------------------------- front end -> engine


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt: dict
    """{'prompt_token_ids': [...], optional 'prompt'}."""
    params: SamplingParams
    lora_request: object | None = None
    """A LoRARequest; None: the base model."""


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class LoadLoRA:
    op: int
    """The operation's number: its LoRAAnswer carries it back."""
    lora_request: object


@dataclass(slots=True)
class UnloadLoRA:
    op: int
    lora_int_id: int
    lora_name: str


@dataclass(slots=True)
class FrontendReady:
    pass


# ------------------------------------------------------------------------------------- engine -> front end


@dataclass(slots=True)
class Baseline:
    """The counts /metrics starts from (the engine's state after the warm-up)."""

    state: EngineState


@dataclass(slots=True)
class StepOutputs:
    items: list = field(default_factory=list)
    """(request_id, Admitted | Update | StreamError | None) pairs, in order."""
    state: EngineState | None = None


@dataclass(slots=True)
class LoRAAnswer:
    op: int
    status: int
    """200, or the HTTP status of the error (400, 404 for a path with no adapter, 500)."""
    message: str


@dataclass(slots=True)
class StopFrontend:
    pass
