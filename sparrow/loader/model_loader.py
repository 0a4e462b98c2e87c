"""Build a model from a path: a ``.gguf`` file or an HF folder (config.json + safetensors).

Quantization: the weight format comes from the registry (``sparrow.quant.registry``): an HF
folder whose config.json has ``quantization_config`` (or that keeps it in ModelOpt's hf_quant_config.json,
AutoGPTQ's quantize_config.json or AutoAWQ's quant_config.json) loads in the format its ``quant_method`` names;
``quantization=<name>`` quantizes a float checkpoint while it loads. Either way the model is built inside
``quant_config_scope`` so each ``Linear`` and ``FusedMoE`` takes the format's method, then
``bind_quant_config`` names those layers and gives the ones the config treats by name (routers, ignored
layers) their own method, all before any tensor is read. After loading, every layer's
``quant_method.process_weights_after_loading`` runs (on-load quantization happens there, layer by layer)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.config import ModelConfig
from sparrow.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from sparrow.layers.logits import QuantizedLMHeadMethod
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
    """The weight-format config (a ``sparrow.quant.QuantizationConfig``; ``UNQUANTIZED`` for float weights)."""


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
        rope_freqs = ckpt.rope_freqs() if ckpt.arch == "gemma4" else None  # Gemma 4's proportional RoPE
        return ModelConfig.from_gguf(ckpt.metadata, ckpt.tensor_names, rope_freqs), True, ckpt
    from sparrow.loader.safetensors import read_config

    return ModelConfig.from_hf(read_config(path)), False, None


def resolve_quant_config(path: Path, is_gguf: bool, quantization: str | None):
    """The weight-format config of a checkpoint: its own ``quantization_config`` (the format its
    ``quant_method`` names; ``quantization`` must then be None, that format's name or the quant_method, any case:
    "gptq" / "AWQ" as vLLM takes them), else on-load quantization
    for ``quantization=<name>``, else ``UNQUANTIZED``. Raises ModelLoadError for an unsupported checkpoint
    quantization and InvalidRequestError for an unknown ``quantization`` value, each naming the supported ones,
    or one naming another format than the checkpoint's."""
    from sparrow.quant import config_for_quantization, config_from_hf
    from sparrow.quant.registry import normalize_quantization

    quantization = normalize_quantization(quantization)
    if is_gguf and quantization in (None, "gguf"):  # the file's own blocks, kept packed
        from sparrow.quant.gguf import GGUFConfig

        return GGUFConfig()
    if not is_gguf:
        from sparrow.loader.safetensors import read_config

        qc = read_config(path).get("quantization_config") or modelopt_quant_config(path) or legacy_quant_config(path)
        if qc:
            config = config_from_hf(qc)
            accepted = list(dict.fromkeys((config.name, str(qc.get("quant_method")).lower())))
            if quantization not in (None, *accepted):
                raise InvalidRequestError(
                    f"quantization={quantization!r} does not match the checkpoint, whose quantization_config "
                    f"(quant_method {qc.get('quant_method')!r}) loads as {config.name!r}: a quantized checkpoint "
                    f"loads in its own format; pass quantization=None or {' or '.join(map(repr, accepted))}")
            return config
    return config_for_quantization(quantization)


def modelopt_quant_config(path: Path) -> dict | None:
    """The ``quantization_config`` of a ModelOpt export that keeps it in ``hf_quant_config.json`` (``{"producer":
    {"name": "modelopt"}, "quantization": {"quant_algo": ..., "exclude_modules": [...]}}``) rather than in
    config.json: its ``quantization`` object with ``quant_method: "modelopt"``; None without the file.
    Raises ModelLoadError for a file that is not a JSON object with a ``quantization`` object."""
    file = path / "hf_quant_config.json"
    if not file.is_file():
        return None
    data = _json_object(file)
    if not isinstance(data.get("quantization"), dict):
        raise ModelLoadError(f"{file} has no \"quantization\" object (a ModelOpt export writes one)")
    return {**data["quantization"], "quant_method": "modelopt"}


def legacy_quant_config(path: Path) -> dict | None:
    """The ``quantization_config`` of a GPTQ / AWQ checkpoint that keeps it in a file of its own rather than in
    config.json, as vLLM reads them: AutoGPTQ's ``quantize_config.json`` (bits, group_size, desc_act, sym) with
    ``quant_method`` "gptq", AutoAWQ's ``quant_config.json`` (w_bit, q_group_size, zero_point, version) with "awq"
    (a file that names its quant_method keeps it; w_bit / q_group_size keys mean AWQ); None without either file
    (or with a quant_config.json naming no bits, another tool's). Raises ModelLoadError for a file that is not a
    JSON object."""
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        file = path / name
        if file.is_file():
            data = _json_object(file)
            if name == "quant_config.json" and not {"w_bit", "bits", "quant_method"} & set(data):
                continue
            return {"quant_method": "awq" if {"w_bit", "q_group_size"} & set(data) else method, **data}
    return None


def _json_object(file: Path) -> dict:
    import json

    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quantization: str | None = None, quantize_lm_head: bool = False) -> LoadedModel:
    """Instantiate the registered architecture and fill its weights. ``quantization``: None or a registered
    format's name (``sparrow.quant.supported_quantization()``, e.g. "fp8": quantize a float checkpoint's
    weights at load; quantized checkpoints are recognized from config.json). ``quantize_lm_head``: the LM head
    in the format too (``CausalLM.quantize_lm_head``). Errors name the problem (missing path, unsupported
    architecture or quantization, missing/misshaped/unused tensor, truncated file, ``quantize_lm_head`` with a
    format that has no quantized LM head)."""
    path = Path(path).expanduser()
    config, is_gguf, ckpt = read_model_config(path)
    quant_config = resolve_quant_config(path, is_gguf, quantization)
    check_quantize_lm_head(quantize_lm_head, quant_config)
    cls = get_model_class(config.architecture)
    model = build_model(cls, config, dtype, device, quant_config)
    native_gguf = is_gguf and quant_config.name == "gguf"
    if is_gguf:  # quantization=<another format>: dequantized here, re-quantized by that format (lossy twice)
        tensors = ckpt.tensors(device="cpu", packed=native_gguf)
    else:
        from sparrow.loader.safetensors import iter_safetensors

        tensors = iter_safetensors(path, device="cpu")
    rope_freqs, kv_scales = [], {}
    params = dict(model.named_parameters())

    def filtered():
        for name, t in tensors:
            if native_gguf:
                t = packed_or_float(model, params, name, t)
            if name == "rope_freqs":
                rope_freqs.append(t)
                continue
            if quant_config.skips_tensor(name):  # the checkpoint's FP8 KV-cache scales: sparrow.kv_cache
                kv_scales[name] = t
                continue
            yield name, t

    from sparrow.quant.registry import describe_checkpoint_tensor

    load_weights(model, filtered(), describe_checkpoint_tensor)
    if kv_scales:
        from sparrow.kv_cache.checkpoint import bind_checkpoint_kv_scales

        n = bind_checkpoint_kv_scales(model, kv_scales)
        log.info("read the k/v scales of %d layers (%s, ...): used by an fp8 KV cache (kv_cache_dtype='fp8'), "
                 "ignored by the model-dtype one", n, next(iter(kv_scales)))
    if rope_freqs:
        for mod in model.modules():
            if hasattr(mod, "set_freq_factors"):
                mod.set_freq_factors(rope_freqs[0])
    finish_loading(model, quant_config, quantize_lm_head)
    if native_gguf:
        from sparrow.quant.gguf import weight_bytes

        packed, other = weight_bytes(model)
        log.info("GGUF weights: %.1f MB of packed blocks + %.1f MB of other parameters (%s dtype), file tensors "
                 "%.1f MB", packed / 1e6, other / 1e6, str(dtype).removeprefix("torch."), ckpt.tensor_bytes / 1e6)
    return LoadedModel(model, config, path, is_gguf, ckpt.metadata if is_gguf else None, quant_config)


def packed_or_float(model, params: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    """GGUF tensor ``t`` (checkpoint name ``name``) as its packed rows uint8 [rows, K // B * T] where the parameter
    it loads into (``params``: ``model.named_parameters()`` as a dict) takes packed blocks (``gguf_blocks``), else
    dequantized to float (gguf-py's formulas); a tensor that is not packed GGUF is returned as it is."""
    from sparrow.quant.gguf import dequantize_packed, is_packed

    if not is_packed(t):
        return t
    target = model.resolve_weight(name)
    param = params.get(target[0]) if target is not None else None
    return t if getattr(param, "gguf_blocks", False) else dequantize_packed(t, name)


def build_model(cls, config, dtype: torch.dtype, device, quant_config) -> torch.nn.Module:
    """Instantiate ``cls(config)`` on ``device`` with uninitialized weights in the formats ``quant_config``
    (a QuantizationConfig; None: unquantized) gives each Linear and routed-expert layer; fill it, then
    ``finish_loading``."""
    from sparrow.quant import UNQUANTIZED, bind_quant_config, quant_config_scope

    quant_config = quant_config if quant_config is not None else UNQUANTIZED
    with torch.device(device), quant_config_scope(quant_config):  # parameters allocated (uninitialized) in place
        model = cls(config, dtype=dtype)
        quant_config = quant_config.for_model(model)  # e.g. the checkpoint's unquantized-module names in ours
        bind_quant_config(model, quant_config)
    return model


def check_quantize_lm_head(quantize_lm_head: bool, quant_config):
    """The LM head method of ``quant_config`` when ``quantize_lm_head`` is on (else None). Raises
    InvalidRequestError when the format has no quantized LM head (float weights included)."""
    from sparrow.quant import UNQUANTIZED
    from sparrow.quant.registry import lm_head_formats

    if not quantize_lm_head:
        return None
    linear_method = (quant_config if quant_config is not None else UNQUANTIZED).get_lm_head_linear_method()
    if linear_method is None:
        formats = lm_head_formats()
        titles = " or ".join(f.title for f in formats) or "quantized"
        how = " or ".join(f"quantization={f.name!r} (--quantization {f.name})" for f in formats)
        raise InvalidRequestError(f"quantize_lm_head needs {titles} linear layers: pass {how or 'a quantization'} "
                                  f"or load an {titles} checkpoint")
    return QuantizedLMHeadMethod(linear_method)


def finish_loading(model: torch.nn.Module, quant_config, quantize_lm_head: bool = False) -> None:
    """After every tensor is loaded: each layer's ``quant_method.process_weights_after_loading`` (on-load
    quantization happens here, one layer at a time), the model's own post-processing, the quantized LM head
    (``quantize_lm_head``), eval mode."""
    for mod in model.modules():
        method = getattr(mod, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(mod)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
    if quantize_lm_head:
        model.quantize_lm_head(check_quantize_lm_head(quantize_lm_head, quant_config))
    model.eval()
