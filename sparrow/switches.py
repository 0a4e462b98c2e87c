"""Runtime switches: every environment variable sparrow reads, with its type, default and meaning.

Each is read once, when this module is first imported; the code reads ``sparrow.switches.NAME`` where it
decides, so a test sets one with ``monkeypatch.setattr(sparrow.switches, "NAME", value)``. ``SWITCHES`` lists
them (environment name -> ``Switch``). A boolean switch takes 1 / 0 (also true / false, on / off, any case);
unset or empty keeps its default; any other value raises ``SwitchError`` naming the variable.

One more variable is read elsewhere, at each call: ``SPARROW_CACHE``, the cache folder (``sparrow.cache``;
default ``~/.cache/sparrow``).
"""
from __future__ import annotations

import dataclasses
import os

from sparrow.errors import SparrowError


class SwitchError(SparrowError, ValueError):
    """An environment switch holds a value sparrow cannot read."""


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str
    """The environment variable."""
    type: type
    default: object
    doc: str
    """What it does, in one line."""


SWITCHES: dict[str, Switch] = {}

_TRUE, _FALSE = ("1", "true", "on"), ("0", "false", "off")


def _bool(name: str, default: bool, doc: str) -> bool:
    SWITCHES[name] = Switch(name, bool, default, doc)
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE or raw in _FALSE:
        return raw in _TRUE
    raise SwitchError(f"environment variable {name}={os.environ[name]!r}: expected 1 or 0 ({doc})")


def _float(name: str, default: float, doc: str, minimum: float = 0.0) -> float:
    SWITCHES[name] = Switch(name, float, default, doc)
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= minimum or value == float("inf"):
        raise SwitchError(f"environment variable {name}={os.environ[name]!r}: expected a number >= {minimum} ({doc})")
    return value


OVERLAP: bool = _bool(
    "SPARROW_OVERLAP", True,
    "queue the next greedy decode step before reading this one's tokens (the scheduler's queue_next plans)")
"""The GPU runs step k + 1 while the host applies step k; off, every plan runs one at a time (its A/B:
benchmarks/README.md, "Switches")."""

PDL: bool = _bool(
    "SPARROW_PDL", True,
    "launch the decode-path Triton kernels with programmatic dependent launch on Hopper (sparrow.kernels.use_pdl)")
"""A kernel is launched while the one before still runs and waits in the kernel for its inputs, so launch latency
and loads that do not depend on them overlap the previous kernel (its A/B: benchmarks/README.md, "Switches")."""

DUAL_STREAM: bool = _bool(
    "SPARROW_DUAL_STREAM", True,
    "Gemma 4 decode graphs run the dense MLP branch on a second stream beside the router + MoE chain")
"""Read when a graph is captured (sparrow.models.gemma4.side_stream); eager steps always run one stream."""

SPEC_CLOSED_BATCH: bool = _bool(
    "SPARROW_SPEC_CLOSED_BATCH", False,
    "Speculative decoding with no request waiting: verify only when each sequence with the most tokens left "
    "drafts and gains the step's cost")
"""Read at each step (sparrow.spec_decode.decoder.SpeculativeDecoder.pays): a batch no waiting request can
join ends with its longest sequences, so other sequences' gains shorten nothing. Off: the drafted sequences'
gains are summed against the step's cost (throughput when finished sequences' slots are taken at once)."""

LORA_UNLOAD_TIMEOUT_S: float = _float(
    "SPARROW_LORA_UNLOAD_TIMEOUT_S", 60.0,
    "seconds /v1/unload_lora_adapter waits for the requests running the adapter before it ends them with an error")
"""Read at each unload (sparrow.server.lora_updates): the adapter's name is gone from /v1/models at once; the
requests that run it (running or waiting) finish first, up to this long."""

TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
"""Triton's own variable, read here as Triton parses it (1 / true / on): Triton runs its kernels in its CPU
interpreter, and sparrow's launchers switch on their interpreter workarounds (``sparrow.kernels.interpreting``).
Triton reads it when a kernel is decorated, so it must be set before sparrow's kernels are imported
(tests/conftest.py sets it on machines without CUDA)."""
SWITCHES["TRITON_INTERPRET"] = Switch("TRITON_INTERPRET", bool, False,
                                      "Triton's CPU interpreter (Triton's variable; sparrow reads it too)")
