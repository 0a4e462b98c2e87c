"""int4 W4A16: 4-bit integer weights, one scale (and optionally a zero point) per group of 32 / 64
/ 128 input columns, activations unquantized.

Shapes: R = rows, N = out features, K = in features, G = ceil(K / group).

Checkpoint layouts, each converted tensor by tensor at load into the kernels' layout
(``sparrow.kernels.gemm.int4``: ``weight_packed`` int32 [N, K / 8], ``weight_scale`` [N, G], ``weight_zero``
uint8 [N, G] or None for symmetric weights; w = (u - zero) * scale):
- compressed-tensors ``pack-quantized`` (``quantization_config = {quant_method: compressed-tensors, format:
  pack-quantized, config_groups: {..: {weights: {num_bits: 4, type: int, strategy: group, group_size,
  symmetric}}}, ignore}``): ``weight_packed`` int32 [N, K / 8] (already the kernels' layout),
  ``weight_scale`` [N, G], ``weight_zero_point`` int32 [ceil(N / 8), G] (zero points packed along N, only
  when asymmetric), ``weight_shape`` [2] = (N, K). Group activation order (``actorder: group``, a
  ``weight_g_idx`` tensor) is refused; ``actorder: weight`` (alias ``static``) orders the calibration only and loads;
- GPTQ (AutoGPTQ / GPTQModel, ``{quant_method: gptq, bits: 4, group_size, desc_act: false, sym,
  checkpoint_format: gptq | gptq_v2}``): ``qweight`` int32 [K / 8, N] (8 codes of one column along K per
  word, low nibble first: the transpose of ours), ``qzeros`` int32 [G, N / 8] (8 columns per word; format
  ``gptq`` stores zero - 1, ``gptq_v2`` the zero), ``scales`` fp16 [G, N], ``g_idx`` int32 [K]. ``desc_act:
  true`` or a ``g_idx`` other than k // group (activation order) raises ModelLoadError; ``g_idx`` may be
  absent. ``lm_head: true`` and ``dynamic`` (GPTQModel's quantized LM head and per-module overrides) are refused;
- AWQ GEMM (AutoAWQ, ``{quant_method: awq, bits: 4, group_size, zero_point: true, version: gemm}``):
  ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8], 8 columns per word in the interleaved
  order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column ``AWQ_ORDER[i]`` of the word's 8), ``scales`` fp16
  [G, N]; w = (q - zero) * scale.
On-load quantization (``quantization="int4"`` on a float checkpoint or a named shape): round to nearest,
symmetric, group 128 (``kernels.gemm.int4.quantize_int4_ref``, compressed-tensors' formula), scales in the model
dtype; each shard of a packed layer quantizes on its own as it arrives (groups run along K, within a row).

Float layers of a checkpoint: those its ``ignore`` (compressed-tensors) / ``modules_to_not_convert`` (GPTQ, AWQ)
names, and with compressed-tensors ``targets`` other than ``Linear`` those the targets leave out; entries are HF
module names, dotted parts of them or ``re:`` regexes, a packed layer (qkv_proj) or a stacked expert layer named by
all its HF parts (q / k / v_proj; every ``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``, as llm-compressor
lists them) or by none (``sparrow.quant.scope.layers_named``).

``Int4Config`` is the format (registered as "int4"; it also loads the checkpoints whose quant_method is
compressed-tensors with format pack-quantized, gptq or awq) and gives ``Int4LinearMethod`` to dense linears
(the float method to routers, the LM head and float layers) and ``sparrow.quant.int4_moe.Int4MoEMethod``
to routed experts. apply: dequantize then matmul in torch (``int4_linear_ref``: the CPU path), the W4A16
Triton kernels on CUDA (``sparrow.kernels.gemm.int4``).
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.int4 import DEFAULT_GROUP, GROUP_SIZES, PACK, num_groups, quantize_int4_ref
from sparrow.quant._compressed_tensors import check_extras
from sparrow.quant.base import LinearMethodBase, QuantizationConfig, mark_unnamed
from sparrow.quant.int4_layouts import AWQ_ORDER, convert, finish_scale, finish_zero, layout_tensors, shape_error, \
    shard_layout
from sparrow.quant.weight_loaders import set_shard_layout
from sparrow.quant.int4_moe import Int4MoEMethod
from sparrow.quant.registry import register_quantization
from sparrow.quant.scope import layers_named
from sparrow.quant.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

LAYOUTS = ("compressed-tensors", "gptq", "awq", "on-load")
_ALWAYS_UNQUANTIZED = re.compile(r"(^|\.)(gate|router|shared_expert_gate|lm_head|embed_tokens)(\.|$)")


# ---- the format --------------------------------------------------------------------------------------------

def _ignored(qc: dict, keys, where: str | None = None) -> tuple[str, ...]:
    out = []
    for key in keys:
        names = qc.get(key) or []
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ModelLoadError(f"int4 checkpoint quantization_config.{where or key} must be a list of module names, "
                                 f"got {names!r}")
        out += names
    return tuple(out)


def _group(value, where: str, k_wide_ok: bool = False) -> int:
    if value not in GROUP_SIZES:
        raise ModelLoadError(f"int4 checkpoint {where}={value!r} is not supported (group sizes: "
                             f"{', '.join(map(str, GROUP_SIZES))})")
    return int(value)


def _from_compressed_tensors(qc: dict) -> dict:
    check_extras(qc, "int4")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise ModelLoadError(f"compressed-tensors checkpoint quantization_config.config_groups must be a non-empty "
                             f"object of scheme objects, got {groups!r}")
    schemes, targets = [], set()
    for gname, grp in groups.items():
        w = grp.get("weights") or {}
        fmt = grp.get("format") or qc.get("format")
        where = f"compressed-tensors config_groups.{gname}"
        if not isinstance(w, dict):
            raise ModelLoadError(f"{where}.weights must be an object of quantization arguments, got {w!r}")
        if fmt != "pack-quantized" or w.get("type", "int") != "int" or w.get("num_bits") != 4:
            raise ModelLoadError(f"{where}: format {fmt!r}, {w.get('type')} {w.get('num_bits')} bits is not int4 "
                                 "pack-quantized")
        if grp.get("input_activations"):
            raise ModelLoadError(f"{where}: quantized activations are not supported (int4 W4A16 only)")
        if w.get("strategy") != "group":
            raise ModelLoadError(f"{where}: weights strategy {w.get('strategy')!r} is not supported (only 'group')")
        if w.get("actorder") not in (None, False, "weight", "static"):  # these order the calibration only
            raise ModelLoadError(f"{where}: activation order (actorder={w.get('actorder')!r}) is not supported")
        schemes.append((_group(w.get("group_size"), f"{where}.weights.group_size"), bool(w.get("symmetric", True))))
        targets |= set(_ignored(grp, ["targets"], "config_groups.*.targets") or ["Linear"])
    if len(set(schemes)) != 1:
        raise ModelLoadError(f"compressed-tensors checkpoint mixes int4 schemes {sorted(set(schemes))}; sparrow "
                             "loads one group size and symmetry per model")
    group, symmetric = schemes[0]
    return dict(layout="compressed-tensors", group=group, symmetric=symmetric, ignored_layers=_ignored(qc, ["ignore"]),
                targets=() if "Linear" in targets else tuple(sorted(targets)))


def _from_gptq_awq(qc: dict, method: str) -> dict:
    bits = qc.get("bits", qc.get("w_bit"))  # w_bit / q_group_size: AutoAWQ's quant_config.json
    if bits != 4:
        raise ModelLoadError(f"{method} checkpoint bits={bits!r} is not supported (only 4)")
    group = _group(qc.get("group_size", qc.get("q_group_size")), f"{method} group_size")
    ignored = _ignored(qc, ["modules_to_not_convert"])
    if method == "gptq":
        if not isinstance(qc.get("desc_act"), (bool, int, type(None))):  # null / 0 / 1 read as false / true
            raise ModelLoadError(f"GPTQ checkpoint desc_act={qc['desc_act']!r} must be true or false")
        if qc.get("desc_act"):
            raise ModelLoadError("GPTQ checkpoint desc_act=true (activation order) is not supported: sparrow loads "
                                 "desc_act=false GPTQ checkpoints")
        if qc.get("lm_head"):
            raise ModelLoadError("GPTQ checkpoint lm_head=true (a quantized LM head) is not supported: sparrow keeps "
                                 "the LM head in float")
        if qc.get("dynamic"):
            raise ModelLoadError(f"GPTQ checkpoint dynamic={qc['dynamic']!r} (per-module overrides or skips) is not "
                                 "supported: sparrow loads one bits / group_size for every quantized module")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"GPTQ checkpoint_format={fmt!r} is not supported ('gptq' or 'gptq_v2')")
        return dict(layout="gptq", group=group, symmetric=bool(qc.get("sym", True)), gptq_v1=fmt == "gptq",
                    ignored_layers=ignored)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or not qc.get("zero_point", True):
        raise ModelLoadError(f"AWQ checkpoint version={version!r} zero_point={qc.get('zero_point')!r} is not "
                             "supported (only the GEMM packing with zero points)")
    return dict(layout="awq", group=group, symmetric=False, ignored_layers=ignored)


QUANTIZE_CHUNK_ROWS = 1024
"""Rows quantized at a time at load (on-load int4): the fp32 temporaries of one chunk, not of a whole tensor, add
to the load's peak (tests/loader/test_load_memory.py)."""


@register_quantization
@dataclasses.dataclass(frozen=True)
class Int4Config(QuantizationConfig):
    """int4 W4A16 weights of a model's Linear layers and routed experts; see the module doc."""

    name = "int4"
    title = "int4"
    help = ("int4: quantize the linear layers and routed experts to 4-bit integers (W4A16, group 128, symmetric) at "
            "load (compressed-tensors pack-quantized, GPTQ and AWQ checkpoints load as int4 without it)")
    hf_quant_methods = ("compressed-tensors", "gptq", "awq")
    checkpoint_tensor_kinds = {"weight_packed": "an int4 packed weight", "qweight": "an int4 packed weight",
                               "weight_zero_point": "int4 zero points", "qzeros": "int4 zero points",
                               "g_idx": "a GPTQ group index", "weight_shape": "a compressed-tensors weight shape"}

    layout: str = "on-load"
    """Where the weights come from: one of ``LAYOUTS``."""
    group: int = DEFAULT_GROUP
    """Input columns per scale."""
    symmetric: bool = True
    """No zero points (zero 8)."""
    gptq_v1: bool = True
    """GPTQ ``checkpoint_format: gptq`` (zeros stored minus 1) rather than ``gptq_v2``."""
    ignored_layers: tuple[str, ...] = ()
    """The checkpoint's module entries left in float (names, ``re:`` regexes: ``sparrow.quant.scope.matches``)."""
    targets: tuple[str, ...] = ()
    """compressed-tensors' module entries that are int4 (the others float); empty: every Linear (``"Linear"``)."""
    float_prefixes: frozenset = frozenset()
    """sparrow's names of the layers those entries leave float (``for_model``)."""
    kv_cache_scales: bool = False
    """The checkpoint declares an FP8 KV cache (``QuantizationConfig.declares_kv_cache``): its scales aren't weights."""

    @classmethod
    def claims_hf(cls, qc: dict) -> bool:
        """A compressed-tensors pack-quantized, GPTQ or AWQ ``quantization_config``."""
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            groups = qc.get("config_groups")
            groups = groups.values() if isinstance(groups, dict) else ()
            return "pack-quantized" in {qc.get("format")} | {g.get("format") for g in groups if isinstance(g, dict)}
        return method in ("gptq", "awq")

    @classmethod
    def from_hf(cls, qc: dict) -> "Int4Config":
        """From config.json's ``quantization_config``. Raises ModelLoadError for settings the format lacks."""
        if not isinstance(qc, dict) or not cls.claims_hf(qc):
            raise ModelLoadError(f"quantization_config {qc!r} is not an int4 (compressed-tensors pack-quantized, "
                                 "GPTQ or AWQ) config")
        method = qc["quant_method"]
        fields = _from_compressed_tensors(qc) if method == "compressed-tensors" else _from_gptq_awq(qc, method)
        return cls(**fields, kv_cache_scales=cls.declares_kv_cache(qc))

    @classmethod
    def for_quantization(cls) -> "Int4Config":
        """``quantization="int4"``: quantize a float checkpoint while loading (symmetric, group 128)."""
        return cls()

    @property
    def from_checkpoint(self) -> bool:
        return self.layout != "on-load"

    def for_model(self, model: nn.Module) -> "Int4Config":
        """This config with the ignore list and targets resolved to sparrow's layer names
        (``sparrow.quant.scope.layers_named``: HF names of packed projections and per-expert linears, checkpoint
        prefixes). Raises ModelLoadError when they name only some parts of one layer (one format per layer)."""
        floats = layers_named(model, self.ignored_layers, "int4", "quantization_config ignore list")
        if self.targets:
            targeted = layers_named(model, self.targets, "int4", "config_groups targets")
            floats |= {n for n, m in model.named_modules() if getattr(m, "quant_kind", None) and n not in targeted}
        return dataclasses.replace(self, float_prefixes=frozenset(floats)) if floats else self

    def quantizes(self, prefix: str) -> bool:
        """Whether the layer named ``prefix`` (sparrow's name) is int4."""
        return not _ALWAYS_UNQUANTIZED.search(prefix) and prefix not in self.float_prefixes

    def get_linear_method(self, prefix: str | None = None) -> LinearMethodBase:
        if prefix is not None and not self.quantizes(prefix):
            return UnquantizedLinearMethod()
        return Int4LinearMethod(self)

    def get_moe_method(self, prefix: str | None = None):
        if prefix is not None and not self.quantizes(prefix):
            return UnquantizedFusedMoEMethod()
        return Int4MoEMethod(self)


class Int4LinearMethod(LinearMethodBase):
    """int4 weights on a ``sparrow.layers.linear.Linear``; see the module doc. Parameters while loading: the
    layout's own names (checkpoint suffixes; on-load: ``weight`` int32 [N, K / 8] + ``weight_scale``), each
    shard converted to the kernel layout as it arrives; after loading ``weight_packed``, ``weight_scale`` and
    ``weight_zero`` (None when symmetric)."""

    def __init__(self, config: Int4Config):
        self.config = config

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        if k % PACK:
            if mark_unnamed(layer):
                return
            hint = " (a checkpoint leaves such a layer float in its ignore list)" if self.config.from_checkpoint else ""
            raise ModelLoadError(f"int4 weights need in features divisible by {PACK}: {layer.prefix!r} has {k}{hint}")
        g = num_groups(k, self.config.group)
        layer.params_dtype = dtype
        layer._int4_scale_dtypes = set()
        shards = len(layer.output_sizes)
        if not self.config.from_checkpoint:
            layer.weight = nn.Parameter(torch.empty(n, k // PACK, dtype=torch.int32), requires_grad=False)
            layer.weight.weight_loader = self._quantizing_loader(layer)
            layer.weight_scale = nn.Parameter(torch.empty(n, g, dtype=dtype), requires_grad=False)
            layer.weight_scale.expected_shards = []  # made by the quantizing loader
            return
        shapes = {"packed": ((n, k // PACK), torch.int32), "scale": ((n, g), torch.float32),
                  "zero": ((n, g), torch.uint8), "shape": ((shards, 2), torch.int64), "g_idx": ((shards, k), torch.int32)}
        for suffix, kind in layout_tensors(self.config):
            shape, dt = shapes[kind]
            param = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
            param.weight_loader = self._checkpoint_loader(layer, kind)
            param.optional = kind == "g_idx"  # only checked: desc_act=false makes it k // group
            set_shard_layout(param, **shard_layout(self.config.layout, kind, self.config.group))
            setattr(layer, suffix, param)

    @staticmethod
    def _rows(layer: nn.Module, shard_id) -> tuple[int, int]:
        if shard_id is None:
            return 0, layer.out_features
        return sum(layer.output_sizes[:shard_id]), layer.output_sizes[shard_id]

    def _checkpoint_loader(self, layer: nn.Module, kind: str):
        cfg = self.config

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            start, rows = self._rows(layer, shard_id)
            t = convert(cfg.layout, kind, loaded, rows, layer.in_features, cfg.group, name, cfg.gptq_v1)
            if kind in ("shape", "g_idx"):  # one row per shard
                param.data[0 if shard_id is None else shard_id].copy_(t[0])
                return
            if kind == "scale":
                layer._int4_scale_dtypes.add(loaded.dtype)
            param.data.narrow(0, start, rows).copy_(t)

        return load

    def _quantizing_loader(self, layer: nn.Module):
        group = self.config.group

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if not loaded.is_floating_point() or loaded.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}; quantization='int4' quantizes a float "
                                     "checkpoint (an int4 checkpoint declares quantization_config in config.json)")
            start, rows = self._rows(layer, shard_id)
            if tuple(loaded.shape) != (rows, layer.in_features):
                raise shape_error(name, loaded, (rows, layer.in_features))
            for r0 in range(0, rows, QUANTIZE_CHUNK_ROWS):  # rows quantize independently: bounded fp32 temporaries
                part = loaded[r0:r0 + QUANTIZE_CHUNK_ROWS]
                packed, scale, _ = quantize_int4_ref(part.to(param.device), group, True, layer.params_dtype)
                param.data.narrow(0, start + r0, part.shape[0]).copy_(packed)
                layer.weight_scale.data.narrow(0, start + r0, part.shape[0]).copy_(scale)

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rename the loaded tensors to the kernel layout's names (``weight_packed``, ``weight_scale``,
        ``weight_zero``); scales back in the checkpoint's dtype; all-8 zero points dropped."""
        if getattr(layer, "weight_packed", None) is not None and hasattr(layer, "int4_group"):
            return
        if not self.config.from_checkpoint:
            tensors = {"packed": layer._parameters.pop("weight").data, "scale": layer._parameters.pop("weight_scale").data}
            dtypes = set()
        else:
            tensors = {kind: layer._parameters.pop(suffix).data for suffix, kind in layout_tensors(self.config)}
            dtypes = layer._int4_scale_dtypes
        layer.weight_packed = nn.Parameter(tensors["packed"], requires_grad=False)
        layer.weight_scale = nn.Parameter(finish_scale(tensors["scale"], dtypes), requires_grad=False)
        zero = finish_zero(tensors.get("zero"))
        layer.weight_zero = None if zero is None else nn.Parameter(zero, requires_grad=False)
        layer._quant_param_names = [n for n in ("weight_packed", "weight_scale", "weight_zero")
                                    if layer._parameters.get(n) is not None]
        layer.int4_group = self.config.group

    def shard_shape(self, layer: nn.Module, param_name: str, rows: int) -> tuple[int, ...]:
        """A shard's checkpoint tensor shape (for the missing-tensor message)."""
        k, g = layer.in_features, num_groups(layer.in_features, self.config.group)
        kind = dict(layout_tensors(self.config)).get(param_name) if self.config.from_checkpoint else None
        gptq_like = self.config.layout in ("gptq", "awq")
        return {"packed": (k // PACK, rows) if self.config.layout == "gptq" else (k, -(-rows // PACK))
                if gptq_like else (rows, k // PACK),
                "scale": (g, rows) if gptq_like else (rows, g),
                "zero": (g, -(-rows // PACK)) if gptq_like else (-(-rows // PACK), g),
                "shape": (2,), "g_idx": (k,)}.get(kind) or super().shard_shape(layer, param_name, rows)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight [N, K] in the scale dtype (tests, debugging)."""
        from sparrow.kernels.gemm.int4 import dequantize_int4_ref

        return dequantize_int4_ref(layer.weight_packed, layer.weight_scale, layer.weight_zero, layer.int4_group)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (+ bias): ``kernels.gemm.int4.int4_linear`` (Triton on CUDA, else the
        dequantize-then-matmul twin)."""
        from sparrow.kernels.gemm.int4 import int4_linear

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = int4_linear(x2, layer.weight_packed, layer.weight_scale, layer.weight_zero, layer.int4_group)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], y.shape[-1])

__all__ = ["AWQ_ORDER", "Int4Config", "Int4LinearMethod", "Int4MoEMethod"]
