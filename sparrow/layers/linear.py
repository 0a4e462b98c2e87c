"""Linear layers whose weight format is a quantization method object (style.md 6).

Shapes: R = rows, K = in_features, N = out_features. Weights are stored [N, K] as in nn.Linear / HF.
A packed linear (``qkv_proj``, ``gate_up_proj``) concatenates several checkpoint tensors along N; the
loader fills each shard through ``weight_loader(param, tensor, shard_id)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.errors import ModelLoadError


GEMV_MAX_ROWS = 0
"""Row counts up to this use the Triton GEMV on the GPU (weights streamed once for all rows) instead of
cuBLAS; 0 disables it. Set from measurements (benchmarks/kernels_micro.py) on the target GPU."""


class UnquantizedLinearMethod:
    """Plain float weights ([N, K] in the model dtype); apply is ``x @ W.T + b``."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        pass

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.is_cuda:
            from sparrow.kernels import use_triton

            if use_triton(x):
                from sparrow.kernels.gemv import gemv_triton

                y = gemv_triton(x, layer.weight)
                return y if layer.bias is None else y + layer.bias
        return F.linear(x, layer.weight, layer.bias)


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
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, dtype)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        for p in self.parameters(recurse=False):
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
