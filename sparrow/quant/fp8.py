"""FP8 W8A8: e4m3 weights with fp32 scales, activations quantized per 128-column row group.

Shapes: R = rows, N = out features, K = in features, NB = ceil(N / 128), KB = ceil(K / 128).

Weight layouts (dequant = q * scale, ``scale`` is what checkpoints call ``weight_scale_inv``):
- block: q [N, K] e4m3, scale [NB, KB] fp32, one per 128 x 128 tile (DeepSeek-V3 / Qwen3 FP8
  checkpoints: ``quantization_config = {quant_method: fp8, weight_block_size: [128, 128]}``);
- per output channel: q [N, K] e4m3, scale [N, 1] fp32 (reference only; the kernels take block scales).
scale = max(amax(|w| over the tile or row), 1e-10) / 448, q = clamp(w / scale, +-448) rounded to nearest
even e4m3. Round trip: |w - dequant(q)| <= 2^-4 * |w| for |w| >= 2^-6 * scale (3 mantissa bits), and
<= 2^-10 * scale below that (e4m3 subnormal step 2^-9 halved).

``Fp8Config`` is the format (registered as "fp8", ``sparrow.quant.registry``) and the per-model config: it
gives ``Fp8LinearMethod`` to each quantized Linear (``UnquantizedLinearMethod`` to routers and ignored
layers), ``sparrow.quant.fp8_moe.Fp8MoEMethod`` to the routed experts and, for ``quantize_lm_head``, an LM
head computed by an on-load ``Fp8LinearMethod`` copy of the LM weight. ``Fp8LinearMethod`` is the method
object on a Linear:
- checkpoint mode (FP8 checkpoint): parameters ``weight`` e4m3 [N, K] and ``weight_scale_inv`` fp32
  [NB, KB], each loaded shard by shard for packed layers; a shard must start on a 128-row boundary
  (else its scale rows would mix two checkpoint tensors) or loading raises ModelLoadError;
- on-load mode (``quantization="fp8"`` on a bf16 / fp32 checkpoint): the loader stages the arriving
  float shards of one layer in a buffer of the model dtype, and when the layer's last shard lands it
  quantizes the whole [N, K] weight in 128 x 128 blocks into ``weight`` / ``weight_scale_inv`` and frees
  the buffer, so peak memory is the FP8 model plus the layers in flight (one or two: checkpoints store a
  layer's tensors together). Quantizing the packed weight equals quantizing each shard when shards are
  128-aligned, so an FP8 checkpoint made offline from the same weights loads to the same bytes.
apply(x [R, K]) -> [R, N] in x's dtype: R <= ``gemv.W8A8_MAX_ROWS`` (16) -> ``gemv_w8a8`` (W8A8: activations
quantized per 128-group in registers, e4m3 tensor cores, each weight byte read once); R <= ``gemv.FP8_MAX_ROWS``
(64) -> ``gemv_fp8`` (W8A16: weights widened in registers, activations unquantized), except from
``scaled_mm_min_rows(layer)`` rows on a device where cuBLAS has block-scaled FP8 (Hopper, CUDA >= 12.9; bf16 /
fp32 activations); there and above 64 rows W8A8: ``scaled_mm.fp8_scaled_mm`` (cuBLAS, activations quantized
by a Triton kernel) where it is available, else ``fp8_gemm`` (Triton). So a row's numbers depend on the batch
size (as in vLLM). The formula depends on the rows, the shape and the device, not on the backend: under
``backend("torch")`` the twins compute what the kernels of the same device would (``sparrow.kernels.use_triton``).
``process_weights_after_loading`` adds the buffer ``scaled_mm_scale`` (the scales in cuBLAS's layout,
``scaled_mm.scaled_mm_weight_scale``) to layers whose shape cuBLAS takes: a copy, so whatever rewrites
``weight_scale_inv`` afterwards must call it again.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.quant.base import LinearMethodBase, QuantizationConfig
from sparrow.quant.fp8_moe import Fp8MoEMethod, check_fp8_tensor
from sparrow.quant.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from sparrow.quant.registry import register_quantization
from sparrow.quant.weight_loaders import set_shard_layout
from sparrow.kernels.gemm.fp8 import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    GROUP,
    dequantize_fp8_block_ref,
    quantize_fp8_block_ref,
)

SCALED_MM_MIN_ROWS = 65
"""Rows from which FP8 linears run cuBLAS's block-scaled GEMM where it is available (see the module doc) ..."""
SCALED_MM_MIN_ROWS_WIDE = 17
"""... and from which weights of at least SCALED_MM_WIDE elements do: from 17 rows cuBLAS (its quantizer
included) is faster than the W8A16 GEMV on a wide weight (gemma4's 2816 x 8192) and slower on the narrower ones up
to 64 rows; from 128 rows it beats the Triton fp8_gemm on every shape (``kernels_micro.py fp8_linears``; the
figures: benchmarks/README.md, "FP8 linears")."""
SCALED_MM_WIDE = 1 << 24


def scaled_mm_min_rows(layer: nn.Module) -> int:
    """Rows from which ``layer`` (an FP8 Linear) takes cuBLAS's block-scaled GEMM where it is available."""
    wide = layer.in_features * layer.out_features >= SCALED_MM_WIDE
    return SCALED_MM_MIN_ROWS_WIDE if wide else SCALED_MM_MIN_ROWS

__all__ = [
    "quantize_fp8_block", "dequantize_fp8_block", "quantize_fp8_channel", "dequantize_fp8_channel",
    "Fp8Config", "Fp8LinearMethod", "check_fp8_tensor",
]

# Linear layers that stay in the model dtype whatever the config says: MoE routers and gates
# (a router's top-k is sensitive to small errors; vLLM / DeepSeek / Qwen FP8 checkpoints keep them bf16).
_ALWAYS_UNQUANTIZED = re.compile(r"(^|\.)(gate|router|shared_expert_gate|lm_head|embed_tokens)(\.|$)")

# The torch references (one implementation, in the kernels package beside the kernels that use them).
quantize_fp8_block = quantize_fp8_block_ref
dequantize_fp8_block = dequantize_fp8_block_ref


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] e4m3, scale [N, 1] fp32), one scale = max(amax, 1e-10) / 448 per row.
    Raises ValueError unless w is 2-D floating point."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_channel: w must be a 2-D float tensor, got {tuple(w.shape)} {w.dtype}")
    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_EPS) / FP8_MAX
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_fp8_channel``: q [N, K] e4m3, scale [N, 1] -> fp32 [N, K]."""
    return q.float() * scale.float().reshape(-1, 1)


@register_quantization
@dataclasses.dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 block-scaled quantization of a model's Linear layers and routed experts."""

    name = "fp8"
    title = "FP8"
    help = ("fp8: quantize the linear layers and routed experts to block-scaled FP8 at load (FP8 checkpoints "
            "load as FP8 without it)")
    checkpoint_tensor_kinds = {"_scale_inv": "an FP8 block scale"}

    from_checkpoint: bool
    """True: the checkpoint holds e4m3 ``weight`` + ``weight_scale_inv``; False: quantize float weights at load."""
    weight_block_size: tuple[int, int] = (GROUP, GROUP)
    """Scale block [rows, cols]; only [128, 128] is supported."""
    ignored_layers: tuple[str, ...] = ()
    """Module-name fragments left unquantized (HF ``modules_to_not_convert`` / ``ignored_layers``)."""

    @classmethod
    def from_hf(cls, qc: dict) -> "Fp8Config":
        """From config.json's ``quantization_config``. Raises ModelLoadError for another method, block size
        or a static activation scheme."""
        if not isinstance(qc, dict):
            raise ModelLoadError(f"checkpoint quantization_config must be an object (a dict), got {qc!r}")
        method = qc.get("quant_method")
        if method != cls.name:
            from sparrow.quant.registry import supported_quantization

            raise ModelLoadError(f"checkpoint quantization_config.quant_method={method!r} is not supported "
                                 f"(supported: {', '.join(supported_quantization())})")
        block = qc.get("weight_block_size")
        try:
            block_ok = block is not None and [int(b) for b in block] == [GROUP, GROUP]
        except (TypeError, ValueError):  # not a list of two integers
            block_ok = False
        if not block_ok:
            raise ModelLoadError(f"FP8 checkpoint weight_block_size={block!r} is not supported (only [128, 128]; "
                                 "per-tensor / per-channel FP8 checkpoints are not loadable yet)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ModelLoadError(f"FP8 checkpoint activation_scheme={scheme!r} is not supported (only 'dynamic')")
        ignored = []
        for key in ("modules_to_not_convert", "ignored_layers"):
            names = qc.get(key) or []
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise ModelLoadError(f"FP8 checkpoint quantization_config.{key} must be a list of module names, "
                                     f"got {names!r}")
            ignored += names
        return cls(from_checkpoint=True, weight_block_size=(GROUP, GROUP), ignored_layers=tuple(ignored))

    @classmethod
    def for_quantization(cls) -> "Fp8Config":
        """``quantization="fp8"``: quantize a float checkpoint's weights while loading."""
        return cls(from_checkpoint=False)

    def for_model(self, model: nn.Module) -> "Fp8Config":
        """This config with ``ignored_layers`` also in ``model``'s module names. Checkpoint configs name HF
        modules: q_proj / k_proj / v_proj and gate_proj / up_proj, which sparrow packs into qkv_proj and
        gate_up_proj, and renamed ones (Mixtral's block_sparse_moe is sparrow's mlp); ``model.resolve_weight``
        maps each name as it maps the checkpoint's tensors. Raises ModelLoadError when the names leave only
        some projections of a packed layer unquantized: its shards share one weight format."""
        linears = [(name, m) for name, m in model.named_modules() if getattr(m, "quant_kind", None) == "linear"]
        extra, packed = [], {}
        for frag in self.ignored_layers:
            resolved = model.resolve_weight(f"{frag}.weight") if frag else None
            if resolved is None:  # outside the text decoder, or a tied lm_head
                continue
            module, shard = resolved[0].rpartition(".")[0], resolved[1]
            if isinstance(shard, int):  # a projection packed into ``module``
                packed.setdefault(module, {}).setdefault(shard, frag)
            elif module != frag:
                extra.append(module)
        for module, shards in packed.items():
            matched = [m for name, m in linears if f".{module}." in f".{name}."]
            if any(set(range(len(m.output_sizes or [0]))) - set(shards) for m in matched):
                raise ModelLoadError(
                    f"FP8 checkpoint leaves {sorted(shards.values())} unquantized (modules_to_not_convert / "
                    f"ignored_layers) but not the other projections sparrow packs with them into {module!r}; a "
                    "packed layer must be all FP8 or all float")
            if matched:
                extra.append(module)
        return dataclasses.replace(self, ignored_layers=self.ignored_layers + tuple(extra)) if extra else self

    def quantizes(self, prefix: str) -> bool:
        """Whether the Linear named ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``) is quantized."""
        if _ALWAYS_UNQUANTIZED.search(prefix):
            return False
        dotted = f".{prefix}."
        return not any(frag and f".{frag}." in dotted for frag in self.ignored_layers)

    def get_linear_method(self, prefix: str | None = None) -> LinearMethodBase:
        """The method of the Linear named ``prefix`` (None: not known yet, FP8)."""
        if prefix is not None and not self.quantizes(prefix):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self.from_checkpoint)

    def get_moe_method(self, prefix: str | None = None):
        """The method of the FusedMoE named ``prefix`` (None: not known yet, FP8)."""
        if prefix is not None and not self.quantizes(prefix):
            return UnquantizedFusedMoEMethod()
        return Fp8MoEMethod(self.from_checkpoint)

    def get_lm_head_linear_method(self) -> "Fp8LinearMethod":
        """An FP8 copy of the LM weight (``Fp8LinearMethod``: 128 x 128 blocks, activations quantized per
        128-group, the kernels of the other FP8 linears) instead of the model-dtype weight: half the bytes of
        the largest matrix read every decode step (Gemma 4: V 262,144 x H 2,816), at the cost of FP8 rounding
        in the logits."""
        return Fp8LinearMethod(from_checkpoint=False)


class Fp8LinearMethod(LinearMethodBase):
    """Block-scaled FP8 weights on a ``sparrow.layers.linear.Linear``; see the module doc."""

    def __init__(self, from_checkpoint: bool = True):
        self.from_checkpoint = from_checkpoint

    # ---- weights ------------------------------------------------------------------------------------

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """``weight`` e4m3 [N, K] and ``weight_scale_inv`` fp32 [NB, KB], both with loaders. ``dtype`` is the
        model dtype (activations, bias, the on-load staging buffer)."""
        n, k = layer.out_features, layer.in_features
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(
            torch.empty(-(-n // GROUP), -(-k // GROUP), dtype=torch.float32), requires_grad=False)
        layer.params_dtype = dtype
        if self.from_checkpoint:
            layer.weight.weight_loader = self._checkpoint_loader(layer)
            layer.weight_scale_inv.weight_loader = self._checkpoint_loader(layer)
            set_shard_layout(layer.weight_scale_inv, n=(0, GROUP), k=(1, GROUP))  # a TP share: whole blocks
        else:
            layer.weight.weight_loader = self._quantizing_loader(layer)
            layer.weight_scale_inv.weight_loader = self._reject_scale
            layer.weight_scale_inv.expected_shards = []  # made by the quantizing loader, not read
            layer._fp8_staging = None
            layer._fp8_staged = set()

    @staticmethod
    def _shard_rows(layer: nn.Module, shard_id: int | None) -> tuple[int, int]:
        if shard_id is None:
            return 0, layer.out_features
        return sum(layer.output_sizes[:shard_id]), layer.output_sizes[shard_id]

    def _checkpoint_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            start, rows = self._shard_rows(layer, shard_id)
            check_fp8_tensor(name, loaded)
            if param is layer.weight:
                if loaded.dtype != FP8_DTYPE:
                    raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}, but the FP8 checkpoint layout needs "
                                         "float8_e4m3fn weights")
                target = param.data.narrow(0, start, rows)
            else:
                if start % GROUP:
                    raise ModelLoadError(
                        f"tensor {name!r}: shard {shard_id} of the packed layer starts at row {start}, not on a "
                        f"{GROUP}-row boundary, so its block scales cannot be placed (packed sizes "
                        f"{layer.output_sizes}); this FP8 checkpoint cannot be loaded packed")
                target = param.data.narrow(0, start // GROUP, -(-rows // GROUP))
            if tuple(loaded.shape) != tuple(target.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
            target.copy_(loaded)

        return load

    def _quantizing_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if not loaded.is_floating_point() or loaded.dtype == FP8_DTYPE:
                raise ModelLoadError(f"tensor {name!r} is {loaded.dtype}; quantization='fp8' quantizes a float "
                                     "checkpoint (an FP8 checkpoint declares quantization_config in config.json)")
            start, rows = self._shard_rows(layer, shard_id)
            if tuple(loaded.shape) != (rows, layer.in_features):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, "
                                     f"expected {(rows, layer.in_features)}")
            if shard_id is None:  # whole weight: quantize straight away, no staging
                self._quantize_into(layer, loaded.to(device=param.device, dtype=layer.params_dtype))
                return
            if layer._fp8_staging is None:
                layer._fp8_staging = torch.empty(layer.out_features, layer.in_features, dtype=layer.params_dtype,
                                                 device=param.device)
            layer._fp8_staging.narrow(0, start, rows).copy_(loaded)
            layer._fp8_staged.add(shard_id)
            if len(layer._fp8_staged) == len(layer.output_sizes):
                self._quantize_into(layer, layer._fp8_staging)
                layer._fp8_staging = None
                layer._fp8_staged = set()

        return load

    @staticmethod
    def _reject_scale(param, loaded, shard_id, name) -> None:
        raise ModelLoadError(f"tensor {name!r}: the checkpoint carries FP8 scales but its config.json has no "
                             "FP8 quantization_config; load it without quantization='fp8' after adding one")

    @staticmethod
    def _quantize_into(layer: nn.Module, w: torch.Tensor) -> None:
        """Quantize w [N, K] into the layer's e4m3 weight and scales a multiple of 128 rows at a time (blocks are
        128 x 128, so the result is the same), about ``kernels.gemm.int4.QUANTIZE_CHUNK`` elements (CPU:
        ``QUANTIZE_CHUNK_CPU``, host memory bounding a load) each, so the fp32 temporaries stay small."""
        from sparrow.kernels.gemm.int4 import QUANTIZE_CHUNK, QUANTIZE_CHUNK_CPU

        chunk = QUANTIZE_CHUNK if w.is_cuda else QUANTIZE_CHUNK_CPU
        chunk_rows = max(1, chunk // (w.shape[1] * GROUP)) * GROUP
        for r0 in range(0, w.shape[0], chunk_rows):
            q, s = quantize_fp8_block_ref(w[r0:r0 + chunk_rows], GROUP)
            layer.weight.data[r0:r0 + q.shape[0]].copy_(q)
            layer.weight_scale_inv.data[r0 // GROUP:r0 // GROUP + s.shape[0]].copy_(s)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Check the on-load quantization finished; make the scales contiguous fp32 (the kernels' layout)."""
        if not self.from_checkpoint and layer._fp8_staging is not None:
            raise ModelLoadError(f"FP8 on-load quantization of a {layer.output_sizes} packed layer got only shards "
                                 f"{sorted(layer._fp8_staged)}")
        if not layer.weight_scale_inv.is_contiguous():
            layer.weight_scale_inv.data = layer.weight_scale_inv.data.contiguous()
        from sparrow.kernels.gemm.scaled_mm import scaled_mm_fits, scaled_mm_weight_scale

        scale_mm = (scaled_mm_weight_scale(layer.weight_scale_inv.data)
                    if scaled_mm_fits(layer.in_features, layer.out_features) else None)
        layer.register_buffer("scaled_mm_scale", scale_mm, persistent=False)

    def shard_shape(self, layer: nn.Module, param_name: str, rows: int) -> tuple[int, ...]:
        """A shard's checkpoint tensor: ``weight`` [rows, K], ``weight_scale_inv`` [ceil(rows / 128), KB]."""
        if param_name == "weight_scale_inv":
            return (-(-rows // GROUP),) + tuple(layer.weight_scale_inv.shape[1:])
        return super().shard_shape(layer, param_name, rows)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as fp32 [N, K] (tests, debugging)."""
        return dequantize_fp8_block_ref(layer.weight, layer.weight_scale_inv, GROUP)

    # ---- compute ------------------------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (+ bias); see the module doc for the kernel choice."""
        from sparrow.kernels import use_triton
        from sparrow.kernels.gemm import gemv
        from sparrow.kernels.gemm.fp8_gemm import fp8_gemm
        from sparrow.kernels.gemm.scaled_mm import SCALED_MM_OUT_DTYPES, fp8_scaled_mm, scaled_mm_supported

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        scale_mm = getattr(layer, "scaled_mm_scale", None)
        cublas = scale_mm is not None and x2.dtype in SCALED_MM_OUT_DTYPES and scaled_mm_supported(x2.device)
        if rows <= gemv.W8A8_MAX_ROWS:
            y = gemv.gemv_w8a8(x2, layer.weight, layer.weight_scale_inv)  # Triton or its twin
        elif rows <= gemv.FP8_MAX_ROWS and not (cublas and rows >= scaled_mm_min_rows(layer)):
            y = gemv.gemv_fp8(x2, layer.weight, layer.weight_scale_inv)  # W8A16: Triton or its twin
        elif cublas and use_triton(x2):
            y = fp8_scaled_mm(x2, layer.weight, scale_mm)
        else:
            y = fp8_gemm(x2, layer.weight, layer.weight_scale_inv)  # Triton or its twin
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], y.shape[-1])
