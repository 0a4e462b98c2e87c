"""NVFP4 weights: e2m1 values packed two per byte, an e4m3 scale per 16 elements of a row, an fp32
global scale per checkpoint tensor (the formulas: ``sparrow.kernels.gemm.nvfp4``). Activations stay in the model
dtype (W4A16); checkpoints' static activation scales (``input_scale`` / ``input_global_scale``, for the FP4
activations of Blackwell's W4A4) are loaded and not used.

Shapes: R = rows, N = out features, K = in features (a multiple of 16), G = K / 16.

Checkpoint layouts (``layout``), the parameter names of a Linear being the checkpoint's:
- "modelopt" (``quantization_config = {quant_method: modelopt, quant_algo: NVFP4}``, or ModelOpt's
  ``hf_quant_config.json``): ``weight`` uint8 [N, K/2], ``weight_scale`` e4m3 [N, G], ``weight_scale_2`` fp32
  scalar (w = e2m1 * weight_scale * weight_scale_2), ``input_scale`` fp32 scalar; ``exclude_modules`` /
  ``ignore`` list the float layers;
- "compressed-tensors" (``quant_method: compressed-tensors``, format ``nvfp4-pack-quantized``, NVFP4 or
  NVFP4A16 schemes): ``weight_packed`` uint8 [N, K/2], ``weight_scale`` e4m3 [N, G], ``weight_global_scale``
  fp32 [1] (the inverse of ModelOpt's: w = e2m1 * weight_scale / weight_global_scale), optional
  ``input_global_scale``; ``ignore`` lists the float layers (names, ``re:`` regexes).
A packed layer (qkv_proj, gate_up_proj) keeps one global scale per shard: the global parameters are per
output row [N] (each filled with its shard's scalar), so a checkpoint whose q / k / v global scales differ
loads exactly.

On-load quantization (``quantization="nvfp4"`` on a float checkpoint / named shape): each arriving float
shard is quantized by ModelOpt's formula (global = amax / (6 * 448), ``quantize_nvfp4_ref``) into the
"modelopt" parameters, so an offline ModelOpt export of the same shards loads to the same bytes.

apply(x [R, K]) -> [R, N] in x's dtype: on CUDA the W4A16 Triton kernel of ``sparrow.kernels.gemm.nvfp4_linear`` (the
int4 linears' 4-bit kernel) at every row count; elsewhere (CPU) the weight dequantized to x's dtype (fp32 products,
as the format's library dequantizes) and ``F.linear``. The routed experts: ``sparrow.quant.nvfp4_moe`` (W4A16
Triton kernels on CUDA, ``sparrow.kernels.moe.nvfp4_moe``).
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.nvfp4 import GROUP, SCALE_DTYPE, dequantize_nvfp4_ref, quantize_nvfp4_ref
from sparrow.quant._compressed_tensors import check_extras
from sparrow.quant.base import LinearMethodBase, QuantizationConfig
from sparrow.quant.nvfp4_moe import NAMES, Nvfp4MoEMethod, check_nvfp4_tensor, global_scale_shape
from sparrow.quant.registry import register_quantization
from sparrow.quant.weight_loaders import set_shard_layout
from sparrow.quant.scope import layers_named
from sparrow.quant.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

LAYOUTS = ("modelopt", "compressed-tensors")
CT_FORMAT = "nvfp4-pack-quantized"

# Linear layers that stay float whatever the config says (routers and gates: top-k is sensitive to error)
_ALWAYS_UNQUANTIZED = re.compile(r"(^|\.)(gate|router|shared_expert_gate|lm_head|embed_tokens)(\.|$)")


def _ct_formats(qc: dict) -> set:
    groups = qc.get("config_groups") or {}
    fmts = {g.get("format") for g in groups.values() if isinstance(g, dict)} if isinstance(groups, dict) else set()
    return ({qc.get("format")} | fmts) - {None}


def _names_list(qc: dict, keys: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for key in keys:
        names = qc.get(key) or []
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ModelLoadError(f"NVFP4 checkpoint quantization_config.{key} must be a list of module names, "
                                 f"got {names!r}")
        out += names
    return tuple(out)


@register_quantization
@dataclasses.dataclass(frozen=True)
class Nvfp4Config(QuantizationConfig):
    """NVFP4 weights on the Linear layers and routed experts; see the module doc."""

    name = "nvfp4"
    title = "NVFP4"
    help = ("nvfp4: quantize the linear layers and routed experts to NVFP4 at load (e2m1 + e4m3 per 16 + fp32 per "
            "tensor, ModelOpt's formula; ModelOpt and compressed-tensors NVFP4 checkpoints load without it)")
    hf_quant_methods = ("modelopt", "compressed-tensors")
    checkpoint_tensor_kinds = {"weight_scale_2": "an NVFP4 (ModelOpt) global scale",
                               "weight_global_scale": "an NVFP4 (compressed-tensors) global scale"}

    layout: str = "modelopt"
    """The checkpoint's layout ("modelopt" / "compressed-tensors"); on-load quantization fills "modelopt"."""
    from_checkpoint: bool = True
    ignored_layers: tuple[str, ...] = ()
    """The checkpoint's ignore entries (module names, wildcards, ``re:`` regexes)."""
    ignored_prefixes: frozenset = frozenset()
    """sparrow's module names those entries name (``for_model``)."""
    kv_cache_scales: bool = False
    """The checkpoint declares an FP8 KV cache (``QuantizationConfig.declares_kv_cache``): its scales aren't weights."""

    @classmethod
    def claims_hf(cls, qc: dict) -> bool:
        """ModelOpt configs (``from_hf`` refuses algorithms other than NVFP4) and compressed-tensors configs in
        format ``nvfp4-pack-quantized``."""
        method = qc.get("quant_method")
        return method == "modelopt" or (method == "compressed-tensors" and CT_FORMAT in _ct_formats(qc))

    @classmethod
    def from_hf(cls, qc: dict) -> "Nvfp4Config":
        """From config.json's ``quantization_config`` (or ModelOpt's hf_quant_config.json). Raises ModelLoadError
        for a ModelOpt algorithm other than NVFP4, a group size other than 16, or compressed-tensors schemes
        other than 4-bit float weights in groups of 16 on Linear layers."""
        if qc.get("quant_method") == "modelopt":
            inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
            algo = inner.get("quant_algo")
            if not isinstance(algo, str) or algo.upper() != "NVFP4":
                raise ModelLoadError(f"ModelOpt checkpoint quant_algo={algo!r} is not supported (sparrow loads "
                                     "ModelOpt NVFP4; FP8 checkpoints load with quant_method 'fp8')")
            if inner.get("group_size", GROUP) != GROUP:
                raise ModelLoadError(f"ModelOpt NVFP4 checkpoint group_size={inner['group_size']!r}: NVFP4 has "
                                     f"{GROUP}")
            return cls("modelopt", True, _names_list(inner, ("exclude_modules", "ignore")),
                       kv_cache_scales=cls.declares_kv_cache(qc))
        check_extras(qc, "NVFP4")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ModelLoadError(f"compressed-tensors checkpoint quantization_config.config_groups must be a "
                                 f"non-empty object, got {groups!r}")
        for gname, group in groups.items():
            w = group.get("weights") if isinstance(group, dict) else None
            fmt = group.get("format") or qc.get("format") if isinstance(group, dict) else None
            ok = (isinstance(w, dict) and w.get("num_bits") == 4 and w.get("type") == "float"
                  and w.get("group_size") == GROUP and w.get("symmetric", True) and fmt == CT_FORMAT)
            if not ok:
                raise ModelLoadError(f"compressed-tensors config group {gname!r} is not NVFP4 (4-bit float weights "
                                     f"in groups of {GROUP}, format {CT_FORMAT!r}): {group!r}; a checkpoint "
                                     "mixing formats is not supported")
            targets = group.get("targets") or []
            if any(t != "Linear" for t in targets):
                raise ModelLoadError(f"compressed-tensors config group {gname!r} targets {targets!r}; sparrow loads "
                                     "NVFP4 groups that target 'Linear'")
        return cls("compressed-tensors", True, _names_list(qc, ("ignore",)), kv_cache_scales=cls.declares_kv_cache(qc))

    @classmethod
    def for_quantization(cls) -> "Nvfp4Config":
        """``quantization="nvfp4"``: quantize a float checkpoint's weights while loading (ModelOpt's formula)."""
        return cls("modelopt", from_checkpoint=False)

    def for_model(self, model: nn.Module) -> "Nvfp4Config":
        """This config with the ignore entries resolved to sparrow's Linear / FusedMoE names (``layers_named``).
        Raises ModelLoadError when they name only some projections of a packed layer or some experts."""
        if not self.ignored_layers:
            return self
        ignored = layers_named(model, self.ignored_layers, "NVFP4", "ignore list")
        return dataclasses.replace(self, ignored_prefixes=ignored)

    def quantizes(self, prefix: str) -> bool:
        """Whether the layer named ``prefix`` holds NVFP4 weights."""
        return not _ALWAYS_UNQUANTIZED.search(prefix) and prefix not in self.ignored_prefixes

    def get_linear_method(self, prefix: str | None = None) -> LinearMethodBase:
        if prefix is not None and not self.quantizes(prefix):
            return UnquantizedLinearMethod()
        return Nvfp4LinearMethod(self.layout, self.from_checkpoint)

    def get_moe_method(self, prefix: str | None = None):
        if prefix is not None and not self.quantizes(prefix):
            return UnquantizedFusedMoEMethod()
        return Nvfp4MoEMethod(self.layout, self.from_checkpoint)


class Nvfp4LinearMethod(LinearMethodBase):
    """NVFP4 weights on a ``sparrow.layers.linear.Linear``; see the module doc. Parameters (names per
    ``layout``, ``NAMES``): codes uint8 [N, K/2], scales e4m3 [N, G], global fp32 [N], activation scale fp32 [N]
    (optional)."""

    def __init__(self, layout: str = "modelopt", from_checkpoint: bool = True):
        if layout not in LAYOUTS:
            raise ValueError(f"Nvfp4LinearMethod: layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.from_checkpoint = layout, from_checkpoint
        self.codes, self.scale, self.global_scale, self.input_scale = NAMES[layout]
        self.divide_global = layout == "compressed-tensors"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        shapes = {self.codes: ((n, -(-k // 2)), torch.uint8), self.scale: ((n, -(-k // GROUP)), SCALE_DTYPE),
                  self.global_scale: ((n,), torch.float32), self.input_scale: ((n,), torch.float32)}
        for pname, (shape, dt) in shapes.items():
            setattr(layer, pname, nn.Parameter(torch.zeros(shape, dtype=dt), requires_grad=False))
        layer.params_dtype = dtype
        getattr(layer, self.input_scale).optional = True
        getattr(layer, self.input_scale).data.fill_(1.0)
        for pname in (self.global_scale, self.input_scale):
            getattr(layer, pname).checkpoint_shape = global_scale_shape(self.layout)  # for load messages
        if self.from_checkpoint:
            for pname, kind in zip(NAMES[self.layout], ("codes", "scale", "global", "global")):
                getattr(layer, pname).weight_loader = self._checkpoint_loader(layer, kind)
            set_shard_layout(getattr(layer, self.codes), k=(1, 2))  # a TP share: whole bytes, whole groups
            set_shard_layout(getattr(layer, self.scale), k=(1, GROUP))
        else:
            getattr(layer, self.codes).weight_loader = self._quantizing_loader(layer)
            for pname in NAMES[self.layout][1:]:
                getattr(layer, pname).weight_loader = self._reject_scale
                getattr(layer, pname).expected_shards = []  # made by the quantizing loader, not read

    @staticmethod
    def _rows(layer: nn.Module, shard_id) -> tuple[int, int]:
        if shard_id is None:
            return 0, layer.out_features
        return sum(layer.output_sizes[:shard_id]), layer.output_sizes[shard_id]

    @staticmethod
    def _check_k(layer: nn.Module, name: str) -> None:
        if layer.in_features % GROUP:
            raise ModelLoadError(f"tensor {name!r}: NVFP4 needs in_features a multiple of {GROUP}, the layer has "
                                 f"{layer.in_features}")

    def _checkpoint_loader(self, layer: nn.Module, kind: str):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            self._check_k(layer, name)
            check_nvfp4_tensor(name, loaded, kind)
            start, rows = self._rows(layer, shard_id)
            target = param.data.narrow(0, start, rows)
            if kind == "global":
                target.fill_(float(loaded.reshape(())))
                return
            if tuple(loaded.shape) != tuple(target.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
            target.copy_(loaded)

        return load

    def _quantizing_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if not loaded.is_floating_point() or loaded.element_size() == 1:
                raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}; quantization='nvfp4' quantizes a float "
                                     "checkpoint (an NVFP4 checkpoint declares quantization_config in config.json)")
            self._check_k(layer, name)
            start, rows = self._rows(layer, shard_id)
            if tuple(loaded.shape) != (rows, layer.in_features):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, "
                                     f"expected {(rows, layer.in_features)}")
            out = (getattr(layer, self.codes).data[start:start + rows],
                   getattr(layer, self.scale).data[start:start + rows])
            _, _, g = quantize_nvfp4_ref(loaded.to(param.device), "modelopt", out=out)  # written in place
            getattr(layer, self.global_scale).data[start:start + rows].fill_(float(g))

        return load

    @staticmethod
    def _reject_scale(param, loaded, shard_id, name) -> None:
        raise ModelLoadError(f"tensor {name!r}: the checkpoint carries NVFP4 scales but its config.json has no "
                             "NVFP4 quantization_config; load it without quantization='nvfp4' after adding one")

    def shard_shape(self, layer: nn.Module, param_name: str, rows: int) -> tuple[int, ...]:
        """A shard's checkpoint tensor: codes [rows, K/2], scales [rows, G], a global / activation scale
        (``global_scale_shape``)."""
        if param_name in (self.global_scale, self.input_scale):
            return global_scale_shape(self.layout)
        return super().shard_shape(layer, param_name, rows)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as fp32 [N, K], as the checkpoint's library dequantizes it."""
        return dequantize_nvfp4_ref(getattr(layer, self.codes), getattr(layer, self.scale),
                                    getattr(layer, self.global_scale), self.divide_global)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Add the buffer ``nvfp4_g`` [N] fp32, each row's global multiplier for the kernels (ModelOpt's
        weight_scale_2, or 1 / compressed-tensors' weight_global_scale): a copy, so whatever rewrites the global
        scales afterwards must call it again."""
        g = getattr(layer, self.global_scale).data.float()
        layer.register_buffer("nvfp4_g", 1.0 / g if self.divide_global else g.clone(), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (+ bias). Where Triton runs (CUDA): the NVFP4 kernel
        (``sparrow.kernels.gemm.nvfp4_linear``, W4A16); elsewhere the weight dequantized to x's dtype as the
        checkpoint's library does, and F.linear."""
        from sparrow.kernels import use_triton

        if use_triton(x) and getattr(layer, "nvfp4_g", None) is not None:
            from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear_triton

            shape = x.shape
            y = nvfp4_linear_triton(x.reshape(-1, shape[-1]), getattr(layer, self.codes), getattr(layer, self.scale),
                                    layer.nvfp4_g)
            y = y if layer.bias is None else y + layer.bias
            return y.reshape(*shape[:-1], y.shape[-1])
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype), layer.bias)
