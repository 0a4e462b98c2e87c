"""Linear layers whose weight format is a quantization method object (style.md 6).

Shapes: R = rows, K = in_features, N = out_features. Weights are stored [N, K] as in nn.Linear / HF.
A packed linear (``qkv_proj``, ``gate_up_proj``) concatenates several checkpoint tensors along N; the
loader fills each shard through ``weight_loader(param, tensor, shard_id, name)``.

Choosing the weight format (design.md 4): model code builds every Linear without naming a format; the
loader builds the model inside ``with quant_config_scope(cfg):`` and each Linear created there takes
``cfg.get_quant_method()`` (e.g. ``sparrow.quant.fp8.Fp8Config``). A Linear does not know its own name
while it is built, so after construction ``bind_quant_config(model, cfg)`` walks ``named_modules()``,
stores each Linear's ``prefix`` and switches the ones the config leaves unquantized (``cfg.quantizes(name)``
False: routers, ignored layers) back to float weights (their uninitialized FP8 tensors are dropped before
any checkpoint tensor is read). A context variable rather than a constructor argument keeps the model
files and the shared blocks (attention, MLP) free of quantization plumbing. Routers (``nn.Linear``), norms,
embeddings and the LM head are not ``Linear`` and stay in the model dtype.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.errors import ModelLoadError


class UnquantizedLinearMethod:
    """Plain float weights ([N, K] in the model dtype); apply is ``x @ W.T + b``."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        pass

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


_QUANT_CONFIG = None  # the config of the model being built (quant_config_scope)


@contextlib.contextmanager
def quant_config_scope(config) -> Iterator[None]:
    """Linears built inside the block take their method from ``config.get_quant_method()`` (None: float)."""
    global _QUANT_CONFIG
    previous, _QUANT_CONFIG = _QUANT_CONFIG, config
    try:
        yield
    finally:
        _QUANT_CONFIG = previous


def bind_quant_config(model: nn.Module, config) -> None:
    """Name every Linear of ``model`` (``layer.prefix``) and give the ones ``config`` leaves unquantized
    float weights. Call after construction, before loading; ``config`` None only names the layers."""
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        module.prefix = name
        if config is None:
            continue
        method = config.get_quant_method(name)
        if method is None and not isinstance(module.quant_method, UnquantizedLinearMethod):
            module.set_quant_method(UnquantizedLinearMethod())


class Linear(nn.Module):
    """y [R, N] = x [R, K] @ W.T (+ bias), computed by ``quant_method``.

    ``output_sizes`` splits N into shards for packed projections (e.g. [q, k, v] sizes); each shard is
    loaded from its own checkpoint tensor by index."""

    def __init__(
        self,
        in_features: int,
        out_features: int | None = None,
        bias: bool = False,
        output_sizes: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        quant_method: UnquantizedLinearMethod | None = None,
    ):
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.params_dtype = dtype
        self.prefix = ""
        self.bias = None
        if quant_method is None and _QUANT_CONFIG is not None:
            quant_method = _QUANT_CONFIG.get_quant_method(None)
        self.set_quant_method(quant_method or UnquantizedLinearMethod())
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.num_shards = len(self.output_sizes)

    def set_quant_method(self, method) -> None:
        """(Re)create the weights with ``method``: drops the previous method's parameters (bias stays),
        allocates the new ones on the same device, binds loaders (a method's own loaders win)."""
        device = self.bias.device if self.bias is not None else None
        for name in getattr(self, "_quant_param_names", ()):
            param = self._parameters.pop(name)
            device = device or param.device
        before = set(self._parameters)
        self.quant_method = method
        with torch.device(device) if device is not None else contextlib.nullcontext():
            method.create_weights(self, self.params_dtype)
        self._quant_param_names = [n for n in self._parameters if n not in before]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)
