"""Linear layers whose weight format is a quantization method object
(``docs/architecture.md``, "The quant-method contract").

Shapes: R = rows, K = in_features, N = out_features. Weights are stored [N, K] as in nn.Linear / HF.
A packed linear (``qkv_proj``, ``gate_up_proj``) concatenates several checkpoint tensors along N; the
loader fills each shard through ``weight_loader(param, tensor, shard_id, name)``.

Choosing the weight format: model code builds every Linear without naming a format; a Linear
built inside ``sparrow.quant.quant_config_scope(cfg)`` takes ``cfg.get_linear_method(None)`` and
``sparrow.quant.bind_quant_config`` later gives it the method for its name (see ``sparrow.quant.base``).
Routers (``nn.Linear``) and norms are not ``Linear`` and stay in the model dtype; the embedding and an untied
LM head are vocab tables with a method of their own (``sparrow.layers.embedding.VocabEmbedding``).
"""
from __future__ import annotations


import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.layers.lora_buffers import add_linear_delta
from sparrow.quant.base import LinearMethodBase, set_layer_method
from sparrow.quant.scope import current_quant_config


class Linear(nn.Module):
    """y [R, N] = x [R, K] @ W.T (+ bias), computed by ``quant_method``.

    ``output_sizes`` splits N into shards for packed projections (e.g. [q, k, v] sizes); each shard is
    loaded from its own checkpoint tensor by index."""

    quant_kind = "linear"
    lora = None
    """The adapter slots' buffers (``sparrow.layers.lora_buffers.LoRABuffers``) when LoRA is enabled."""

    def __init__(
        self,
        in_features: int,
        out_features: int | None = None,
        bias: bool = False,
        output_sizes: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        quant_method: LinearMethodBase | None = None,
    ):
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.params_dtype = dtype
        self.prefix = ""
        self.bias = None
        self.set_quant_method(quant_method or current_quant_config().get_linear_method(None))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.num_shards = len(self.output_sizes)

    def set_quant_method(self, method) -> None:
        """(Re)create the weights with ``method``: drops the previous method's parameters (bias stays),
        allocates the new ones on the same device, binds loaders (a method's own loaders win)."""
        set_layer_method(self, method, self.bias.device if self.bias is not None else None)
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader
            p.num_shards = len(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None, name: str) -> None:
        """Copy a checkpoint tensor (whole, or shard ``shard_id`` of a packed layer) into ``param``.

        Raises ModelLoadError naming the tensor when its shape does not fit."""
        if shard_id is None:
            target = param.data
        else:
            start = sum(self.output_sizes[:shard_id])
            target = param.data.narrow(0, start, self.output_sizes[shard_id])
        if tuple(loaded.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """x [R, K] -> [R, N]. ``batch``: the step's ForwardBatch (per-row facts such as adapter ids), when the
        caller runs inside a model step: rows with an adapter get its delta B (A x), added to the base output in
        the activation dtype whatever the weight format."""
        y = self.quant_method.apply(self, x)
        if self.lora is not None and batch is not None and batch.adapter_ids is not None:
            y = add_linear_delta(self.lora, x, y, batch.adapter_ids)
        return y
