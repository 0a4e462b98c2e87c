"""Parameter-side weight loaders: the ``weight_loader(param, tensor, shard_id, name)`` a parameter carries,
which the generic loader (``sparrow.loader.weights.load_weights``) calls for each checkpoint tensor.

Stacked experts (``bind_expert_loaders``): ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] are filled
in place, one expert slice per checkpoint tensor as the tensors stream by (shard id (e, block): rows
block*I:(block+1)*I of expert e), or whole from a fused 3-D tensor; no second stacked copy is ever built.
The formats' expert methods make such parameters (``unquantized.stacked_expert_param``, ``on_load``).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.errors import ModelLoadError


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Copy a whole tensor into ``param`` (cast to its dtype); ModelLoadError on a shape mismatch."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def expert_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Load one (expert, block) slice of a stacked expert parameter, or the whole of it (shard id None);
    ModelLoadError for an expert past the parameter's or a misshaped tensor."""
    if shard_id is None:
        return default_weight_loader(param, loaded, None, name)
    expert, block = shard_id
    if expert >= param.shape[0]:
        raise ModelLoadError(f"tensor {name!r} names expert {expert}, but the model has {param.shape[0]} experts")
    rows = param.shape[1] // param.expert_blocks
    target = param.data[expert].narrow(0, block * rows, rows)
    if tuple(loaded.shape) != tuple(target.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def bind_expert_loaders(param: nn.Parameter, blocks: int) -> None:
    """Make a stacked expert parameter [E, blocks * rows, cols] loadable from per-expert tensors (shard id
    (expert, block), each [rows, cols]) or from one fused [E, blocks * rows, cols] tensor (shard id None)."""
    param.weight_loader = expert_loader
    param.expert_blocks = blocks
    param.expected_shards = [(e, b) for e in range(param.shape[0]) for b in range(blocks)]
