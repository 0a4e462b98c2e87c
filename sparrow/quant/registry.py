"""The weight-format registry: name (a checkpoint's ``quantization_config.quant_method``, the ``quantization=``
argument) -> ``QuantizationConfig`` subclass. A format is one module of ``sparrow.quant`` that decorates its
config class with ``@register_quantization``; every module of the package is imported on the first lookup
(one whose optional third-party package is missing is skipped), so adding a format touches nothing else. The loader, the CLI choices, ``LLM(quantization=...)``, the
weight-name table's unused-tensor message and the MoE tile-config file names all read from here.
"""
from __future__ import annotations

import importlib
import pathlib
import pkgutil

from sparrow.errors import InvalidRequestError, ModelLoadError
from sparrow.quant.base import QuantizationConfig
from sparrow.quant.unquantized import UNQUANTIZED

_FORMATS: dict[str, type[QuantizationConfig]] = {}
_LOADED = False
_NOT_FORMATS = {"base", "registry", "scope", "unquantized"}


def register_quantization(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    """Class decorator: make ``cls`` the format named ``cls.name``. Raises ValueError for an empty name or
    one another class already holds."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__}: a registered format needs a name")
    held = _FORMATS.get(cls.name)
    if held is not None and held.__qualname__ != cls.__qualname__:
        raise ValueError(f"quantization format {cls.name!r} is already registered by {held.__qualname__}")
    _FORMATS[cls.name] = cls
    return cls


def unregister_quantization(name: str) -> None:
    """Remove the format named ``name`` (a test's stand-in format); KeyError when none is registered."""
    del _FORMATS[name]


def _load_formats() -> None:
    """Import every module of ``sparrow.quant`` once (each format registers itself on import)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)]):
        if info.name in _NOT_FORMATS or info.name.startswith("_"):
            continue
        importlib.import_module(f"sparrow.quant.{info.name}")


def formats() -> tuple[type[QuantizationConfig], ...]:
    """Every registered format, in registration order."""
    _load_formats()
    return tuple(_FORMATS.values())


def supported_quantization() -> tuple[str, ...]:
    """The registered formats' names: ``LLM(quantization=...)`` / ``--quantization`` values that quantize a float
    checkpoint at load (besides None; ``checkpoint_quantization`` lists the ones naming a checkpoint's format)."""
    _load_formats()
    return tuple(_FORMATS)


def checkpoint_quantization() -> tuple[str, ...]:
    """The checkpoint ``quant_method`` names the formats load that are not format names ("gptq", "awq",
    "compressed-tensors", "modelopt"): ``quantization=`` accepts them on such a checkpoint, as vLLM does."""
    _load_formats()
    return tuple(dict.fromkeys(m for f in _FORMATS.values() for m in f.hf_quant_methods if m not in _FORMATS))


def _supported_text() -> str:
    return ", ".join(["None", *map(repr, supported_quantization() + checkpoint_quantization())])


def normalize_quantization(name: str | None) -> str | None:
    """``name`` in lower case (vLLM's spelling rule: "AWQ" is "awq") when it is None, a registered format or a
    ``checkpoint_quantization`` name. Raises InvalidRequestError naming it and the supported ones."""
    if name is None:
        return None
    _load_formats()
    if not isinstance(name, str) or name.lower() not in supported_quantization() + checkpoint_quantization():
        raise InvalidRequestError(f"quantization={name!r} is not supported (supported: {_supported_text()})")
    return name.lower()


def get_quantization(name: str) -> type[QuantizationConfig]:
    """The format registered as ``name`` (any case). Raises InvalidRequestError naming it and the supported ones."""
    _load_formats()
    key = normalize_quantization(name)
    if key not in _FORMATS:
        raise InvalidRequestError(
            f"quantization={name!r} names a checkpoint format, which loads from its checkpoint only (a float "
            f"checkpoint quantizes at load with {', '.join(map(repr, supported_quantization()))})")
    return _FORMATS[key]


def check_quantization(name: str | None) -> None:
    """Raise InvalidRequestError unless ``name`` is None, a registered format or a checkpoint format name."""
    normalize_quantization(name)


def config_for_quantization(name: str | None) -> QuantizationConfig:
    """The config of ``quantization=name`` on a float checkpoint: ``UNQUANTIZED`` for None. Raises
    InvalidRequestError for a checkpoint format name (``checkpoint_quantization``) or an unknown one."""
    return UNQUANTIZED if name is None else get_quantization(name).for_quantization()


def config_from_hf(qc) -> QuantizationConfig:
    """The config of a checkpoint's ``quantization_config``: the first format that claims it
    (``QuantizationConfig.claims_hf``: its ``quant_method`` by default; ``quant_method`` read in any case). Raises
    ModelLoadError for a non-object config or one no format claims, naming the supported methods."""
    if not isinstance(qc, dict):
        raise ModelLoadError(f"checkpoint quantization_config must be an object (a dict), got {qc!r}")
    _load_formats()
    method = qc.get("quant_method")
    if isinstance(method, str) and method != method.lower():  # "GPTQ", "AWQ": any case, as vLLM reads them
        method = method.lower()
        qc = {**qc, "quant_method": method}
    fmt = next((f for f in _FORMATS.values() if f.claims_hf(qc)), None)  # by name, or a format's claims_hf
    if not isinstance(method, str) or fmt is None:
        known = sorted({m for f in _FORMATS.values() for m in (f.name, *f.hf_quant_methods)})
        what = " with these settings" if method in known else ""  # a shared method none of its formats claims
        raise ModelLoadError(f"checkpoint quantization_config.quant_method={method!r}{what} is not supported "
                             f"(supported: {', '.join(known)})")
    return fmt.from_hf(qc)


def lm_head_formats() -> tuple[type[QuantizationConfig], ...]:
    """The formats with a quantized LM head (``get_lm_head_linear_method`` of their own)."""
    return tuple(f for f in formats()
                 if f.get_lm_head_linear_method is not QuantizationConfig.get_lm_head_linear_method)


def describe_checkpoint_tensor(name: str) -> tuple[str, str] | None:
    """(format title, what the tensor is) for a checkpoint tensor name one format's suffixes claim, else None."""
    for fmt in formats():
        for suffix, kind in fmt.checkpoint_tensor_kinds.items():
            if name.endswith(suffix):
                return fmt.title, kind
    return None
