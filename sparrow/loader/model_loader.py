"""Build a model from a path: a ``.gguf`` file or an HF folder (config.json + safetensors).

Quantization (design.md 4): an HF folder whose config.json has ``quantization_config`` (``quant_method:
"fp8"``, ``weight_block_size: [128, 128]``) is an FP8 checkpoint; ``quantization="fp8"`` quantizes a float
checkpoint while it loads. Either way the model is built inside ``quant_config_scope`` so each
``sparrow.layers.linear.Linear`` takes the config's method, then ``bind_quant_config`` names the Linears and
returns the ones the config skips (routers, ignored layers) to float weights, all before any tensor is read.
After loading, every layer's ``quant_method.process_weights_after_loading`` runs, and with on-load FP8 the
routed experts (``FusedMoE``) are quantized to e4m3 + 128 x 128 block scales layer by layer. In an FP8 checkpoint the
experts are e4m3 too: each FusedMoE is given e4m3 weights and fp32 scale parameters before loading, filled
per expert (``experts.N.gate_proj.weight`` + ``.weight_scale_inv``) or fused (``experts.gate_up_proj`` +
``experts.gate_up_proj_scale_inv``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.config import ModelConfig
from sparrow.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from sparrow.loader.weights import load_weights
from sparrow.models.registry import get_model_class

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    path: Path
    is_gguf: bool
    gguf_metadata: dict | None = None
    quant_config: object | None = None
    """The weight-format config (``sparrow.quant.fp8.Fp8Config``) or None for float weights."""


def read_model_config(path: str | Path) -> tuple[ModelConfig, bool, object]:
    """(config, is_gguf, checkpoint handle) for a path; ModelNotFoundError if it does not exist."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is neither a .gguf file nor an HF checkpoint folder")
        from sparrow.loader.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        return ModelConfig.from_gguf(ckpt.metadata, ckpt.tensor_names), True, ckpt
    from sparrow.loader.safetensors import read_config

    return ModelConfig.from_hf(read_config(path)), False, None


def resolve_quant_config(path: Path, is_gguf: bool, quantization: str | None):
    """The quantization config for a checkpoint: the checkpoint's own ``quantization_config`` (FP8), else
    on-load quantization for ``quantization="fp8"``, else None. Raises ModelLoadError for an unsupported
    checkpoint quantization and InvalidRequestError for an unknown ``quantization`` value."""
    from sparrow.quant.fp8 import SUPPORTED_QUANTIZATION, Fp8Config

    if quantization is not None and quantization not in SUPPORTED_QUANTIZATION:
        raise InvalidRequestError(f"quantization={quantization!r} is not supported "
                                  f"(supported: None, {', '.join(map(repr, SUPPORTED_QUANTIZATION))})")
    if not is_gguf:
        from sparrow.loader.safetensors import read_config

        qc = read_config(path).get("quantization_config")
        if qc:
            return Fp8Config.from_hf(qc)  # the checkpoint's format wins; quantization="fp8" agrees with it
    if quantization == "fp8":
        return Fp8Config(from_checkpoint=False)
    return None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quantization: str | None = None, quantize_lm_head: bool = False) -> LoadedModel:
    """Instantiate the registered architecture and fill its weights. ``quantization``: None or "fp8"
    (quantize a float checkpoint's Linear weights at load; FP8 checkpoints are recognized from config.json).
    ``quantize_lm_head``: with FP8 linears, also an FP8 LM head (``CausalLM.quantize_lm_head``).
    Errors name the problem (missing path, unsupported architecture or quantization, missing/misshaped/
    unused tensor, truncated file, ``quantize_lm_head`` without FP8 linears)."""
    path = Path(path).expanduser()
    config, is_gguf, ckpt = read_model_config(path)
    quant_config = resolve_quant_config(path, is_gguf, quantization)
    check_quantize_lm_head(quantize_lm_head, quant_config)
    cls = get_model_class(config.architecture)
    model = build_model(cls, config, dtype, device, quant_config)
    if is_gguf:
        tensors = ckpt.tensors(device="cpu")
    else:
        from sparrow.loader.safetensors import iter_safetensors

        tensors = iter_safetensors(path, device="cpu")
    rope_freqs = []

    def filtered():
        for name, t in tensors:
            if name == "rope_freqs":
                rope_freqs.append(t)
                continue
            yield name, t

    load_weights(model, filtered())
    if rope_freqs:
        for mod in model.modules():
            if hasattr(mod, "set_freq_factors"):
                mod.set_freq_factors(rope_freqs[0])
    finish_loading(model, quant_config, quantize_lm_head)
    return LoadedModel(model, config, path, is_gguf, ckpt.metadata if is_gguf else None, quant_config)


def build_model(cls, config, dtype: torch.dtype, device, quant_config) -> torch.nn.Module:
    """Instantiate ``cls(config)`` on ``device`` with uninitialized weights in the formats ``quant_config``
    (None, or an Fp8Config) gives each Linear and routed-expert layer; fill it, then ``finish_loading``."""
    from sparrow.layers.linear import bind_quant_config, quant_config_scope

    with torch.device(device), quant_config_scope(quant_config):  # parameters allocated (uninitialized) in place
        model = cls(config, dtype=dtype)
        if quant_config is not None:  # the checkpoint's unquantized-module names in sparrow's names
            quant_config = quant_config.for_model(model)
        bind_quant_config(model, quant_config)
    if quant_config is not None and quant_config.from_checkpoint:
        _fp8_checkpoint_experts(model, quant_config)
    return model


def check_quantize_lm_head(quantize_lm_head: bool, quant_config) -> None:
    """Raise InvalidRequestError unless ``quantize_lm_head`` is off or the linears are FP8 (``quant_config``)."""
    if quantize_lm_head and quant_config is None:
        raise InvalidRequestError("quantize_lm_head needs FP8 linear layers: pass quantization='fp8' "
                                  "(--quantization fp8) or load an FP8 checkpoint")


def finish_loading(model: torch.nn.Module, quant_config, quantize_lm_head: bool = False) -> None:
    """After every tensor is loaded: each Linear's ``process_weights_after_loading`` (on-load FP8 quantizes
    here), on-load FP8 of the routed experts, the model's own post-processing, the FP8 LM head copy
    (``quantize_lm_head``), eval mode."""
    for mod in model.modules():
        method = getattr(mod, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(mod)
    if quant_config is not None and not quant_config.from_checkpoint:
        _quantize_experts(model, quant_config)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
    if quantize_lm_head:
        check_quantize_lm_head(quantize_lm_head, quant_config)
        model.quantize_lm_head()
    model.eval()


def _fp8_checkpoint_experts(model: torch.nn.Module, quant_config) -> None:
    """FP8 checkpoint of an MoE model: each quantized FusedMoE gets e4m3 expert weights and fp32 block
    scales (``w13_scale`` / ``w2_scale``), loaded per expert (``experts.N.gate_proj.weight_scale_inv``) or
    fused (``experts.gate_up_proj_scale_inv``, transformers 5's FP8 experts) like the weights."""
    from sparrow.layers.moe import FusedMoE
    from sparrow.loader.weights import bind_expert_loaders

    for name, mod in model.named_modules():
        if isinstance(mod, FusedMoE) and quant_config.quantizes(name):
            mod.create_fp8_weights()
            for pname, blocks in (("gate_up_proj", 2), ("down_proj", 1), ("w13_scale", 2), ("w2_scale", 1)):
                bind_expert_loaders(getattr(mod, pname), blocks)


def _quantize_experts(model: torch.nn.Module, quant_config) -> None:
    """On-load FP8 of the routed experts: each FusedMoE the config quantizes, one layer (and one expert)
    at a time."""
    from sparrow.layers.moe import FusedMoE

    for name, mod in model.named_modules():
        if isinstance(mod, FusedMoE) and quant_config.quantizes(name):
            mod.quantize_fp8(name)
