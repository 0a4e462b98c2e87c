"""The generic weight loader: checkpoint (name, tensor) pairs -> the model's parameters.

The model maps each checkpoint name to (parameter name, shard id) with ``resolve_weight`` (packed
projections, stacked experts); the parameter's ``weight_loader(param, tensor, shard_id, name)`` copies it.
Loading fails loudly, naming the tensor, on unused checkpoint tensors, misshaped tensors and parameters
left unfilled (style.md 5).
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from sparrow.errors import ModelLoadError

log = logging.getLogger(__name__)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Copy a whole tensor into ``param`` (cast to its dtype); ModelLoadError on a shape mismatch."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def expected_shards(param: nn.Parameter) -> list:
    """The shard ids that must all be loaded for ``param`` to be complete."""
    if hasattr(param, "expected_shards"):
        return list(param.expected_shards)
    n = getattr(param, "num_shards", 1)
    return [None] if n == 1 else list(range(n))


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of ``model`` from ``tensors``. Raises ModelLoadError naming the first unused
    tensor, misshaped tensor, or missing parameter (with its expected shape)."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    skipped = 0
    for name, tensor in tensors:
        target = model.resolve_weight(name)
        if target is None:
            skipped += 1
            continue
        pname, shard = target
        if pname not in params:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} is not used by {type(model).__name__} (no parameter {pname!r})"
            )
        param = params[pname]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard, name)
        loaded.setdefault(pname, set()).add(shard)
    if skipped:
        log.info("skipped %d checkpoint tensors outside the text decoder", skipped)
    for pname, param in params.items():
        missing = [s for s in expected_shards(param) if s not in loaded.get(pname, set())]
        if missing:
            which = "" if missing == [None] else f" (shards {missing})"
            raise ModelLoadError(
                f"checkpoint lacks the tensor for {pname!r}{which}, expected shape {tuple(param.shape)}"
            )
