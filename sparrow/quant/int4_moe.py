"""int4 W4A16 routed experts (``FusedMoE``), the method object of ``sparrow.quant.int4.Int4Config`` for the experts.

Shapes: E = experts, H = hidden, I = expert width, G1 = ceil(H / group), G2 = ceil(I / group).

Parameters after loading (the kernel layout of ``sparrow.kernels.gemm.int4``, stacked like the float experts):
``gate_up_proj`` int32 [E, 2I, H / 8], ``w13_scale`` [E, 2I, G1], ``w13_zero`` uint8 [E, 2I, G1] or None;
``down_proj`` int32 [E, H, I / 8], ``w2_scale`` [E, H, G2], ``w2_zero`` or None.
- checkpoint mode: per-expert tensors as published MoE checkpoints hold them
  (``mlp.experts.N.gate_proj.weight_packed`` / ``.weight_scale`` / ``.weight_zero_point`` / ``.weight_shape``;
  GPTQ / AWQ ``.qweight`` / ``.qzeros`` / ``.scales`` (/ ``.g_idx``)), each converted to the kernel layout as
  it arrives (``sparrow.quant.int4.convert``) and copied into its expert's rows;
- on-load mode (``quantization="int4"``): one layer's experts at a time load in the model dtype
  (``sparrow.quant.on_load``), then ``process_weights_after_loading`` quantizes them one expert at a time (symmetric, group 128).
apply: dequantize the experts to x's dtype and run the float paths of ``sparrow.kernels.moe.moe_ref`` (CPU, the
twin), the W4A16 Triton kernels where Triton runs (``sparrow.kernels.moe.int4_moe``).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.int4 import PACK, dequantize_int4_ref, num_groups, quantize_int4_ref
from sparrow.quant.base import FusedMoEMethodBase, mark_unnamed
from sparrow.quant.int4_layouts import convert, finish_scale, finish_zero, layout_tensors, shard_layout
from sparrow.quant.weight_loaders import set_shard_layout
from sparrow.quant.on_load import create_staged_experts
from sparrow.quant.unquantized import stacked_expert_param

_STACKED = (("gate_up_proj", "w13"), ("down_proj", "w2"))


def _param_name(stacked: str, kind: str) -> str:
    prefix = dict(_STACKED)[stacked]
    return stacked if kind == "packed" else f"{prefix}_{kind}"


class Int4MoEMethod(FusedMoEMethodBase):
    """int4 experts; see the module doc. ``config``: the model's ``Int4Config``."""

    def __init__(self, config):
        self.config = config
        if config.from_checkpoint:
            self.checkpoint_tensors = tuple(
                (suffix, f"_{suffix}", stacked, _param_name(stacked, kind))
                for stacked, _ in _STACKED for suffix, kind in layout_tensors(config))

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        h, i = layer.hidden_size, layer.intermediate_size
        if h % PACK or i % PACK:
            if mark_unnamed(layer):
                return
            raise ModelLoadError(f"int4 experts need hidden size and expert width divisible by {PACK}: "
                                 f"{layer.prefix!r} has {h} and {i}")
        layer._int4_scale_dtypes = set()
        if not self.config.from_checkpoint:  # float experts, one layer at a time (quant.on_load)
            create_staged_experts(layer, dtype, self)
            return
        group = self.config.group
        for stacked, rows, k, blocks in (("gate_up_proj", 2 * i, h, 2), ("down_proj", h, i, 1)):
            g = num_groups(k, group)
            cols = {"packed": (rows, k // PACK, torch.int32), "scale": (rows, g, torch.float32),
                    "zero": (rows, g, torch.uint8), "shape": (blocks, 2, torch.int64),
                    "g_idx": (blocks, k, torch.int32)}
            for suffix, kind in layout_tensors(self.config):
                r, c, dt = cols[kind]
                param = stacked_expert_param(layer, r, c, blocks, dt)
                param.weight_loader = self._loader(layer, kind, rows // blocks, k, param.weight_loader)
                param.optional = kind == "g_idx"  # only checked: desc_act=false makes it k // group
                set_shard_layout(param, **shard_layout(self.config.layout, kind, group))
                setattr(layer, _param_name(stacked, kind), param)

    def _loader(self, layer: nn.Module, kind: str, rows: int, k: int, expert_loader):
        cfg = self.config

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if shard_id is None:
                raise ModelLoadError(f"tensor {name!r}: fused 3-D int4 expert tensors are not supported (sparrow "
                                     "loads per-expert tensors, experts.N.gate_proj...)")
            t = convert(cfg.layout, kind, loaded, rows, k, cfg.group, name, cfg.gptq_v1)
            if kind == "scale":
                layer._int4_scale_dtypes.add(loaded.dtype)
            expert_loader(param, t, shard_id, name)

        return load

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Checkpoint mode: scales back in their dtype, all-8 zeros dropped, check-only tensors freed. On-load
        mode: quantize the float experts one expert at a time."""
        if hasattr(layer, "int4_group"):
            return
        group = self.config.group
        for stacked, prefix in _STACKED:
            if self.config.from_checkpoint:
                scale = finish_scale(layer._parameters.pop(f"{prefix}_scale").data, layer._int4_scale_dtypes)
                zero = layer._parameters.pop(f"{prefix}_zero", None)
                zero = finish_zero(None if zero is None else zero.data)
                for kind in ("shape", "g_idx"):
                    layer._parameters.pop(f"{prefix}_{kind}", None)
            else:
                w = layer._parameters.pop(stacked).data
                e, n, k = w.shape
                packed = torch.empty(e, n, k // PACK, dtype=torch.int32, device=w.device)
                scale = torch.empty(e, n, num_groups(k, group), dtype=w.dtype, device=w.device)
                for x in range(e):
                    packed[x], scale[x], _ = quantize_int4_ref(w[x], group, True, w.dtype)
                del w
                layer.register_parameter(stacked, nn.Parameter(packed, requires_grad=False))
                zero = None
            layer.register_parameter(f"{prefix}_scale", nn.Parameter(scale, requires_grad=False))
            setattr(layer, f"{prefix}_zero", None if zero is None else nn.Parameter(zero, requires_grad=False))
        layer._quant_param_names = [n for n in layer._parameters if layer._parameters[n] is not None]
        layer.int4_group = group

    def dequantized_experts(self, layer: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in ``dtype`` (the torch path; tests)."""
        g = layer.int4_group
        return (dequantize_int4_ref(layer.gate_up_proj, layer.w13_scale, layer.w13_zero, g).to(dtype),
                dequantize_int4_ref(layer.down_proj, layer.w2_scale, layer.w2_zero, g).to(dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              reduce: bool = True, lora=None) -> torch.Tensor:
        from sparrow.kernels.moe.int4_moe import int4_fused_moe

        return int4_fused_moe(x, layer.gate_up_proj, layer.w13_scale, layer.w13_zero, layer.down_proj, layer.w2_scale,
                              layer.w2_zero, layer.int4_group, topk_weights, topk_ids, layer.activation,
                              pair_threshold=layer.pair_threshold, swiglu_limit=layer.swiglu_limit, reduce=reduce,
                              lora=lora)
