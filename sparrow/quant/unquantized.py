"""The unquantized format: weights in the model dtype (``quantization=None`` on a float checkpoint; GGUF,
dequantized at load). Its method objects are the defaults of ``Linear`` and ``FusedMoE`` (a vocab table's,
``base.UnquantizedEmbeddingMethod``, is every format's default)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref
from sparrow.quant.base import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
from sparrow.quant.weight_loaders import bind_expert_loaders


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain float weights ([N, K] in the model dtype); apply is ``x @ W.T + b``."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


def stacked_expert_param(layer: nn.Module, rows: int, cols: int, blocks: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized stacked expert parameter [E, rows, cols] of ``dtype``, loadable from per-expert tensors
    [rows / blocks, cols] (shard id (expert, block)) or one fused tensor (``weight_loaders.bind_expert_loaders``)."""
    param = nn.Parameter(torch.empty(layer.num_experts, rows, cols, dtype=dtype), requires_grad=False)
    bind_expert_loaders(param, blocks)
    return param


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Expert weights in the model dtype: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]. apply: the Triton
    grouped GEMM / per-expert GEMV (``sparrow.kernels.moe.moe.fused_moe``) where Triton runs, else the torch path
    chosen by P vs ``pair_threshold``."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        h, i = layer.hidden_size, layer.intermediate_size
        layer.gate_up_proj = stacked_expert_param(layer, 2 * i, h, 2, dtype)
        layer.down_proj = stacked_expert_param(layer, h, i, 1, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              reduce: bool = True, lora=None) -> torch.Tensor:
        from sparrow.kernels import use_triton

        if use_triton(x):  # Triton grouped GEMM / per-expert GEMV (sparrow/kernels/moe/moe.py)
            from sparrow.kernels.moe.moe import fused_moe

            return fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids, layer.activation,
                             w13_scale=None, w2_scale=None,
                             pair_threshold=layer.pair_threshold, swiglu_limit=layer.swiglu_limit, reduce=reduce,
                             lora=lora)
        path = fused_moe_grouped_ref if topk_ids.numel() > layer.pair_threshold else fused_moe_per_pair_ref
        return path(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids, layer.activation,
                    layer.swiglu_limit, reduce=reduce, lora=lora)


class UnquantizedConfig(QuantizationConfig):
    """Weights in the model dtype (``quantization=None`` on a float checkpoint; GGUF, dequantized at load)."""

    title = "float"

    def get_linear_method(self, prefix: str | None) -> LinearMethodBase:
        return UnquantizedLinearMethod()

    def get_moe_method(self, prefix: str | None) -> FusedMoEMethodBase:
        return UnquantizedFusedMoEMethod()


UNQUANTIZED = UnquantizedConfig()
