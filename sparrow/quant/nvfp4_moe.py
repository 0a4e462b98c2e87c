"""NVFP4 routed experts (``FusedMoE``), the expert method of ``sparrow.quant.nvfp4.Nvfp4Config``.

Shapes: E = experts, H = hidden, I = expert width (H and I multiples of 16), R = rows, K = top-k.

Parameters, stacked at load from per-expert checkpoint tensors (``experts.N.gate_proj.<suffix>``, suffixes of
the layout: ``sparrow.quant.nvfp4.NAMES``): ``gate_up_proj`` uint8 [E, 2I, H/2] / ``down_proj`` uint8
[E, H, I/2] (e2m1 codes), ``w13_weight_scale`` e4m3 [E, 2I, H/16] / ``w2_weight_scale`` e4m3 [E, H, I/16],
``w13_global`` fp32 [E, 2, 1] (the gate's and the up projection's global scales) / ``w2_global`` [E, 1, 1],
and the unused activation scales ``w13_input_scale`` / ``w2_input_scale`` (optional, same shapes).
On-load mode (``quantization="nvfp4"``): one layer's experts at a time load in the model dtype
(``sparrow.quant.on_load``), then
``process_weights_after_loading`` quantizes each expert's gate, up and down projection by ModelOpt's formula
(one global scale each, as an offline per-expert export has) into those parameters ("modelopt" convention).
apply: ``sparrow.kernels.moe.nvfp4_moe`` (W4A16 Triton kernels on CUDA; on CPU its twin: the selected experts
dequantized to x's dtype, fp32 products, and the float paths of ``sparrow.kernels.moe.moe_ref``).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.nvfp4 import GROUP, SCALE_DTYPE, quantize_nvfp4_ref
from sparrow.quant.base import FusedMoEMethodBase
from sparrow.quant.on_load import create_staged_experts
from sparrow.quant.unquantized import stacked_expert_param
from sparrow.quant.weight_loaders import set_shard_layout

NAMES = {  # checkpoint suffix of (e2m1 codes, e4m3 scales, global scale, activation scale) per layout
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}


def global_scale_shape(layout: str) -> tuple[int, ...]:
    """The checkpoint shape of a projection's global / activation scale: ModelOpt writes a scalar, compressed-tensors
    a [1] tensor (its ``generate_gparam``)."""
    return () if layout == "modelopt" else (1,)


_PARAMS = {"gate_up_proj": ("gate_up_proj", "w13_weight_scale", "w13_global", "w13_input_scale"),
           "down_proj": ("down_proj", "w2_weight_scale", "w2_global", "w2_input_scale")}
_KINDS = ("codes", "scale", "global", "global")


def check_nvfp4_tensor(name: str, loaded: torch.Tensor, kind: str) -> None:
    """Raise ModelLoadError naming checkpoint tensor ``name`` unless it has the dtype of its ``kind`` ("codes":
    uint8, "scale": float8_e4m3fn with no NaN byte, "global": one finite positive float)."""
    if kind == "codes" and loaded.dtype != torch.uint8:
        raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}; NVFP4 weights are uint8 (two e2m1 codes a byte)")
    if kind == "scale":
        if loaded.dtype != SCALE_DTYPE:
            raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}; NVFP4 scales are float8_e4m3fn")
        if bool(((loaded.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise ModelLoadError(f"tensor {name!r} (NVFP4 e4m3 scales) holds NaN bytes: the checkpoint is corrupt")
    if kind == "global":
        if loaded.numel() != 1 or not loaded.is_floating_point():
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)} {loaded.dtype}; an NVFP4 global / "
                                 "activation scale is one float")
        if not (torch.isfinite(loaded).all() and bool((loaded > 0).all())):
            raise ModelLoadError(f"tensor {name!r} (an NVFP4 global scale) is {float(loaded.reshape(()))}, not a "
                                 "finite positive number: the checkpoint is corrupt")


class Nvfp4MoEMethod(FusedMoEMethodBase):
    """NVFP4 experts; see the module doc. ``layout``: the checkpoint's ("modelopt" / "compressed-tensors");
    ``from_checkpoint``: NVFP4 tensors in the checkpoint (True) or quantize float experts after loading."""

    def __init__(self, layout: str = "modelopt", from_checkpoint: bool = True):
        self.layout, self.from_checkpoint = layout, from_checkpoint
        self.divide_global = layout == "compressed-tensors"
        names = NAMES[layout]
        self.checkpoint_tensors = tuple(  # per-expert suffix, fused suffix, stacked name, parameter
            (names[j], "" if j == 0 else f"_{names[j]}", stacked, params[j])
            for j in range(4) for stacked, params in _PARAMS.items())

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if not self.from_checkpoint:  # float experts, one layer at a time (quant.on_load)
            create_staged_experts(layer, dtype, self)
            return
        h, i = layer.hidden_size, layer.intermediate_size
        for stacked, rows, k, blocks in (("gate_up_proj", 2 * i, h, 2), ("down_proj", h, i, 1)):
            shapes = ((rows, -(-k // 2), torch.uint8), (rows, -(-k // GROUP), SCALE_DTYPE),
                      (blocks, 1, torch.float32), (blocks, 1, torch.float32))
            for pname, kind, (r, c, dt) in zip(_PARAMS[stacked], _KINDS, shapes):
                param = stacked_expert_param(layer, r, c, blocks, dt)
                param.weight_loader = self._checkpoint_loader(layer, param.weight_loader, kind, k)
                if kind == "global":
                    param.checkpoint_shape = global_scale_shape(self.layout)  # for load messages
                else:  # a TP share of an expert's codes / scales: whole bytes, whole groups
                    set_shard_layout(param, k=(1, 2 if kind == "codes" else GROUP))
                setattr(layer, pname, param)
            getattr(layer, _PARAMS[stacked][3]).optional = True

    @staticmethod
    def _checkpoint_loader(layer: nn.Module, expert_loader, kind: str, k: int):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if k % GROUP:
                raise ModelLoadError(f"tensor {name!r}: NVFP4 experts need hidden size and expert width multiples "
                                     f"of {GROUP}, the layer has {layer.hidden_size} and {layer.intermediate_size}")
            if kind == "global" and shard_id is not None:
                check_nvfp4_tensor(name, loaded, kind)
                loaded = loaded.float().reshape(1, 1)
            elif kind != "global":
                check_nvfp4_tensor(name, loaded, kind)
            expert_loader(param, loaded, shard_id, name)

        return load

    def dequantized(self, layer: nn.Module, stacked: str) -> torch.Tensor:
        """The stacked weight ``stacked`` ("gate_up_proj" / "down_proj") as fp32 [E, rows, cols]."""
        from sparrow.kernels.moe.nvfp4_moe import dequantize_nvfp4_experts

        codes, scale, glob, _ = (getattr(layer, p) for p in _PARAMS[stacked])
        return dequantize_nvfp4_experts(codes, scale, glob, self.divide_global)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On-load mode: quantize the loaded float experts (see the module doc)."""
        if self.from_checkpoint or getattr(layer, "w13_global", None) is not None:
            return
        for stacked, blocks in (("gate_up_proj", 2), ("down_proj", 1)):
            w = getattr(layer, stacked)
            e, n, k = w.shape
            if k % GROUP:
                raise ModelLoadError(f"quantization='nvfp4': the experts {layer.prefix!r} of hidden size "
                                     f"{layer.hidden_size} and width {layer.intermediate_size} are not multiples of "
                                     f"{GROUP}")
            out = (torch.empty(e, n, k // 2, dtype=torch.uint8, device=w.device),
                   torch.empty(e, n, k // GROUP, dtype=SCALE_DTYPE, device=w.device),
                   torch.empty(e, blocks, 1, dtype=torch.float32, device=w.device),
                   torch.ones(e, blocks, 1, dtype=torch.float32, device=w.device))
            rows = n // blocks
            for x in range(e):
                for b in range(blocks):
                    part = slice(b * rows, (b + 1) * rows)
                    _, _, g = quantize_nvfp4_ref(w.data[x, part], "modelopt", out=(out[0][x, part], out[1][x, part]))
                    out[2][x, b].copy_(g)
            del w
            for pname, t in zip(_PARAMS[stacked], out):
                setattr(layer, pname, nn.Parameter(t, requires_grad=False))  # the float tensor is freed here

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              reduce: bool = True, lora=None) -> torch.Tensor:
        """``sparrow.kernels.moe.nvfp4_moe.nvfp4_fused_moe``: the W4A16 Triton kernels where Triton runs, else the twin
        (the selected experts dequantized, the float paths of ``moe_ref``); ``lora``: per-pair adapter deltas."""
        from sparrow.kernels.moe.nvfp4_moe import nvfp4_fused_moe

        return nvfp4_fused_moe(x, layer.gate_up_proj, layer.w13_weight_scale, layer.w13_global, layer.down_proj,
                               layer.w2_weight_scale, layer.w2_global, topk_weights, topk_ids, layer.activation,
                               divide_global=self.divide_global, pair_threshold=layer.pair_threshold,
                               swiglu_limit=layer.swiglu_limit, reduce=reduce, lora=lora)
