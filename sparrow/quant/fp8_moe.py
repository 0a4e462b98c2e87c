"""FP8 routed experts (``FusedMoE``): e4m3 stacked weights with fp32 128 x 128 block scales, the method object of
``sparrow.quant.fp8.Fp8Config`` for the experts.

Shapes: E = experts, H = hidden, I = expert width, R = rows, K = top-k.

Parameters: ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] e4m3 and ``w13_scale`` [E, ceil(2I/128),
ceil(H/128)] / ``w2_scale`` [E, ceil(H/128), ceil(I/128)] fp32 (DeepSeek ``weight_scale_inv`` layout:
dequant = q * scale of the 128 x 128 block).
- checkpoint mode: the loader fills them per expert (``experts.N.gate_proj.weight`` + ``.weight_scale_inv``)
  or fused (transformers 5: ``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``). A per-expert
  checkpoint needs H and I multiples of 128 (a gate block and an up block must not share a scale row), so
  loading a tensor into unaligned experts raises ModelLoadError;
- on-load mode (``quantization="fp8"`` on a float checkpoint): one layer's experts at a time load in the model
  dtype (``sparrow.quant.on_load``), and when the layer's last tensor lands ``process_weights_after_loading`` quantizes each stacked weight one expert slice at a time into a new e4m3
  tensor and drops the float one (extra memory: one e4m3 copy of one weight plus one expert's fp32
  temporaries). Widths that are not multiples of 128 get partial last blocks (with I = 704, as Gemma 4
  26B-A4B, one gate|up scale block spans the last gate rows and the first up rows), which the kernels and
  the torch twin read as such.
apply: ``sparrow.kernels.moe.moe.fused_moe`` with the scales where Triton runs, else its torch twin
``fused_moe_fp8_ref`` (W8A8: activations quantized per 128-column group).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.fp8 import FP8_DTYPE, GROUP, quantize_fp8_block_ref
from sparrow.quant.on_load import create_staged_experts
from sparrow.quant.unquantized import stacked_expert_param
from sparrow.quant.base import FusedMoEMethodBase
from sparrow.quant.weight_loaders import set_shard_layout


def fp8_checkpoint_aligned(layer: nn.Module) -> bool:
    """Whether 128 x 128 block scales tile each per-expert checkpoint tensor of ``layer`` exactly (H and I
    multiples of 128). On-load quantization has no such need: it scales the packed [2I, H] / [H, I] weights."""
    return layer.hidden_size % GROUP == 0 and layer.intermediate_size % GROUP == 0


def check_fp8_tensor(name: str, tensor: torch.Tensor) -> None:
    """Raise ModelLoadError naming checkpoint tensor ``name`` when it is a block scale (``*_scale_inv``) with a
    NaN / inf (it would turn every output it touches into NaN) or e4m3 with NaN bytes (S.1111.111: e4m3fn has
    no inf, and no quantizer writes NaN): a corrupt checkpoint."""
    if name.endswith("_scale_inv") and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ModelLoadError(f"checkpoint tensor {name!r} (FP8 block scales) holds non-finite values (nan or inf): "
                             "the checkpoint is corrupt")
    if tensor.dtype == FP8_DTYPE and bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ModelLoadError(f"checkpoint tensor {name!r} (float8_e4m3fn) holds NaN bytes (0x7f / 0xff): the "
                             "checkpoint is corrupt")



class Fp8MoEMethod(FusedMoEMethodBase):
    """Block-scaled FP8 experts; see the module doc. ``from_checkpoint``: e4m3 tensors in the checkpoint
    (True) or quantize float experts after loading (False)."""

    checkpoint_tensors = FusedMoEMethodBase.checkpoint_tensors + (
        ("weight_scale_inv", "_scale_inv", "gate_up_proj", "w13_scale"),
        ("weight_scale_inv", "_scale_inv", "down_proj", "w2_scale"))

    def __init__(self, from_checkpoint: bool = True):
        self.from_checkpoint = from_checkpoint

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if not self.from_checkpoint:  # float experts, one layer at a time (quant.on_load)
            create_staged_experts(layer, dtype, self)
            return
        h, i = layer.hidden_size, layer.intermediate_size
        nb = lambda n: -(-n // GROUP)  # noqa: E731  (scale blocks of n rows / columns)
        for pname, rows, cols, blocks, dt in (("gate_up_proj", 2 * i, h, 2, FP8_DTYPE), ("down_proj", h, i, 1, FP8_DTYPE),
                                              ("w13_scale", nb(2 * i), nb(h), 2, torch.float32),
                                              ("w2_scale", nb(h), nb(i), 1, torch.float32)):
            param = stacked_expert_param(layer, rows, cols, blocks, dt)
            param.weight_loader = self._checkpoint_loader(layer, param.weight_loader)
            if dt == torch.float32:  # a TP share of an expert's scales: whole blocks
                set_shard_layout(param, n=(0, GROUP), k=(1, GROUP))
            setattr(layer, pname, param)

    @staticmethod
    def _checkpoint_loader(layer: nn.Module, expert_loader):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if not fp8_checkpoint_aligned(layer):
                raise ModelLoadError(
                    f"tensor {name!r}: FP8 checkpoint routed experts with hidden size {layer.hidden_size} and expert "
                    f"width {layer.intermediate_size} are not tiled by {GROUP} x {GROUP} scale blocks")
            if (param.dtype == FP8_DTYPE) != (loaded.dtype == FP8_DTYPE):
                raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}, but the FP8 checkpoint's experts need "
                                     f"{param.dtype} (weights e4m3 with fp32 weight_scale_inv)")
            check_fp8_tensor(name, loaded)
            expert_loader(param, loaded, shard_id, name)

        return load

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On-load mode: quantize the loaded float experts in place (see the module doc)."""
        if self.from_checkpoint or getattr(layer, "w13_scale", None) is not None:
            return
        scales = {}
        for pname in ("gate_up_proj", "down_proj"):
            w = getattr(layer, pname)
            e, n, k = w.shape
            q = torch.empty(e, n, k, dtype=FP8_DTYPE, device=w.device)
            s = torch.empty(e, -(-n // GROUP), -(-k // GROUP), dtype=torch.float32, device=w.device)
            for i in range(e):
                qi, si = quantize_fp8_block_ref(w.data[i], GROUP)
                q[i].copy_(qi)
                s[i].copy_(si)
                del qi, si
            setattr(layer, pname, nn.Parameter(q, requires_grad=False))  # the float tensor is freed here
            del w
            scales[pname] = s
        layer.w13_scale = nn.Parameter(scales["gate_up_proj"], requires_grad=False)
        layer.w2_scale = nn.Parameter(scales["down_proj"], requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              reduce: bool = True, lora=None) -> torch.Tensor:
        from sparrow.kernels import use_triton

        if use_triton(x):  # Triton grouped GEMM / per-expert GEMV (sparrow/kernels/moe/moe.py)
            from sparrow.kernels.moe.moe import fused_moe

            return fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids, layer.activation,
                             w13_scale=layer.w13_scale, w2_scale=layer.w2_scale,
                             pair_threshold=layer.pair_threshold, swiglu_limit=layer.swiglu_limit, reduce=reduce,
                             lora=lora)
        from sparrow.kernels.moe.moe import fused_moe_fp8_ref

        return fused_moe_fp8_ref(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids,
                                 layer.activation, layer.swiglu_limit, w13_scale=layer.w13_scale,
                                 w2_scale=layer.w2_scale, reduce=reduce, lora=lora)


def quantize_experts(layer: nn.Module) -> None:
    """Make a loaded float ``FusedMoE`` FP8 in place (on-load quantization of that layer alone: tests, A/B)."""
    layer.quant_method = Fp8MoEMethod(from_checkpoint=False)
    layer.quant_method.process_weights_after_loading(layer)
