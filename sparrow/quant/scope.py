"""Which weight format the layers being built take: ``quant_config_scope`` around a model's construction, then
``bind_quant_config`` to give each named layer its method; ``layers_named`` reads a checkpoint's lists of module
names (ignore lists, targets) as sparrow's layer names."""
from __future__ import annotations

import contextlib
import fnmatch
import re
from typing import Iterator

from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.quant.base import QuantizationConfig
from sparrow.quant.unquantized import UNQUANTIZED

_EXPERT_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""The per-expert linears of a stacked expert layer, as HF and as Mixtral / MiniMax name them."""


_QUANT_CONFIG: QuantizationConfig = UNQUANTIZED  # the config of the model being built (quant_config_scope)


def current_quant_config() -> QuantizationConfig:
    """The config of the innermost ``quant_config_scope`` (``UNQUANTIZED`` outside any)."""
    return _QUANT_CONFIG


@contextlib.contextmanager
def quant_config_scope(config: QuantizationConfig | None) -> Iterator[None]:
    """Linears and FusedMoEs built inside the block take their method from ``config`` (None: unquantized)."""
    global _QUANT_CONFIG
    previous, _QUANT_CONFIG = _QUANT_CONFIG, config if config is not None else UNQUANTIZED
    try:
        yield
    finally:
        _QUANT_CONFIG = previous


def bind_quant_config(model: nn.Module, config: QuantizationConfig | None) -> None:
    """Name every method-holding layer of ``model`` (``layer.prefix``) and give it ``config``'s method for that
    name where it differs in type from the one it was built with (e.g. a router or an ignored layer back to
    float weights). Call after construction, before loading; ``config`` None only names the layers."""
    for name, module in model.named_modules():
        kind = getattr(module, "quant_kind", None)
        if kind is None:
            continue
        module.prefix = name
        if config is None:
            continue
        method = config.get_method(kind, name)
        if type(method) is not type(module.quant_method) or getattr(module, "quant_unnamed", False):
            module.set_quant_method(method)  # quant_unnamed: the method raises now, naming the layer


def matches(pattern: str, name: str) -> bool:
    """Whether a checkpoint's module entry names module ``name``: ``re:<regex>`` (compressed-tensors; ``re.match``),
    a wildcard pattern (ModelOpt ``exclude_modules``, fnmatch), or a module name / dotted part of one."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return bool(pattern) and f".{pattern}." in f".{name}."


def hf_names(model: nn.Module, prefix: str) -> list[list[str]]:
    """The checkpoint spellings of sparrow's module ``prefix``: [spellings of ``prefix`` itself, then those of
    each projection packed into it in shard order (``qkv_proj`` -> q_proj / k_proj / v_proj)], each under the
    checkpoint's prefixes (``prefix_map``) and old module names (``renames``) too."""
    head, _, leaf = prefix.rpartition(".")
    shards = sorted((idx, src) for src, (dst, idx) in getattr(model, "packed_modules", {}).items() if dst == leaf)
    groups = []
    for n in [prefix] + [f"{head}.{src}" if head else src for _, src in shards]:
        for old, new in getattr(model, "renames", ()):
            n = n.replace(new, old)
        groups.append([n] + [src + n[len(dst):] for src, dst in getattr(model, "prefix_map", {}).items()
                             if n.startswith(dst)])
    return groups


def layers_named(model: nn.Module, entries, what: str, where: str) -> frozenset:
    """sparrow's names of the Linear / FusedMoE layers of ``model`` that a checkpoint's module ``entries`` (``matches``)
    name in HF spelling: the layer itself, every projection packed into it (q / k / v_proj of qkv_proj), or every
    per-expert linear of a stacked expert layer (``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``, or Mixtral's
    ``w1`` / ``w3`` / ``w2``, for all N). Raises ModelLoadError when they name only some of those parts (``what``:
    the format, ``where``: the config field, for the message): one layer holds one format."""
    entries = tuple(entries)
    if not entries:
        return frozenset()

    def hit(spellings: list[str]) -> bool:
        return any(matches(p, n) for p in entries for n in spellings)

    named = set()
    for name, module in model.named_modules():
        kind = getattr(module, "quant_kind", None)
        if kind is None:
            continue
        spellings = hf_names(model, name)
        if hit(spellings[0]):
            named.add(name)
            continue
        if kind == "moe":
            options = [[[f"{n}.{e}.{p}" for n in spellings[0]] for e in range(module.num_experts) for p in projs]
                       for projs in _EXPERT_PROJECTIONS]
        else:
            options = [spellings[1:]]
        hits = [[hit(part) for part in parts] for parts in options]
        if any(h and all(h) for h in hits):
            named.add(name)
        elif any(any(h) for h in hits):
            parts, h = next((parts, h) for parts, h in zip(options, hits) if any(h))
            raise ModelLoadError(f"{what} checkpoint {where} names {parts[h.index(True)][0]!r} but not "
                                 f"{parts[h.index(False)][0]!r}: it names only some of the parts packed into {name!r}, "
                                 f"which sparrow loads as one layer, all {what} or all float")
    return frozenset(named)
