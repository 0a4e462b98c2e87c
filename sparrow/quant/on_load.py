"""On-load quantization of routed experts in bounded memory: the float experts of one ``FusedMoE`` layer exist
only while that layer's tensors stream in.

A format that quantizes float experts at load (``quantization="fp8" | "int4" | "nvfp4"`` on a float checkpoint)
gives its layer ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] on the meta device (no memory). The first
checkpoint tensor of the layer allocates both on the build device in the model dtype; the tensor that completes
both (every (expert, block) shard, or the fused 3-D tensors) runs the format's
``process_weights_after_loading`` at once, which quantizes them and drops the float copies. So the peak during
load is the quantized model plus the layers in flight (checkpoints store a layer's tensors together: one), not
the whole float model. The dense linears of these formats quantize shard by shard or layer by layer in their
own loaders (``fp8.Fp8LinearMethod``, ``int4.Int4LinearMethod``, ``nvfp4.Nvfp4LinearMethod``).

A layer whose tensors never all arrive stays on meta; ``loader.weights.load_weights`` then raises
ModelLoadError naming the missing shard, as for any parameter.
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.devices import release_freed_host_memory
from sparrow.quant.weight_loaders import bind_expert_loaders, expert_loader

_STACKED = ("gate_up_proj", "down_proj")


def create_staged_experts(layer: nn.Module, dtype: torch.dtype, method) -> None:
    """Give ``layer`` (a FusedMoE) meta float ``gate_up_proj`` / ``down_proj`` whose loaders allocate them on
    the first tensor and call ``method.process_weights_after_loading(layer)`` when the last one lands (see the
    module doc). ``dtype``: the model dtype of the staged copy; the build device is the current default device
    (``loader.model_loader.build_model`` builds under ``torch.device``)."""
    h, i = layer.hidden_size, layer.intermediate_size
    device = torch.empty(0).device
    layer._staging_pending = {}
    for pname, rows, cols, blocks in (("gate_up_proj", 2 * i, h, 2), ("down_proj", h, i, 1)):
        param = nn.Parameter(torch.empty(layer.num_experts, rows, cols, dtype=dtype, device="meta"),
                             requires_grad=False)
        bind_expert_loaders(param, blocks)
        param.weight_loader = _staging_loader(layer, pname, device, method)
        layer._staging_pending[pname] = set(param.expected_shards)
        setattr(layer, pname, param)


def _materialize(layer: nn.Module, device: torch.device) -> None:
    """Replace the layer's meta stacked experts by uninitialized ones on ``device``, same loaders."""
    for pname in _STACKED:
        meta = layer._parameters[pname]
        if not meta.is_meta:
            continue
        real = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=False)
        real.weight_loader, real.expert_blocks = meta.weight_loader, meta.expert_blocks
        real.expected_shards = meta.expected_shards
        layer._parameters[pname] = real


def _staging_loader(layer: nn.Module, pname: str, device: torch.device, method):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
        pending = layer._staging_pending
        if pname not in pending:  # quantized already: a second copy of a tensor
            from sparrow.errors import ModelLoadError

            raise ModelLoadError(f"tensor {name!r} arrives after {layer.prefix!r} was complete and quantized (the "
                                 "checkpoint holds it twice)")
        _materialize(layer, device)
        expert_loader(layer._parameters[pname], loaded, shard_id, name)
        if shard_id is None:
            pending[pname].clear()
        else:
            pending[pname].discard(shard_id)
        if not any(pending.values()):
            layer._staging_pending = {}
            with torch.no_grad():
                method.process_weights_after_loading(layer)
            release_freed_host_memory(device)

    return load
