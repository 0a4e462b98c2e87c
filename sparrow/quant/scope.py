"""Which weight format the layers being built take: ``quant_config_scope`` around a model's construction, then
``bind_quant_config`` to give each named layer its method."""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from sparrow.quant.base import QuantizationConfig
from sparrow.quant.unquantized import UNQUANTIZED


_QUANT_CONFIG: QuantizationConfig = UNQUANTIZED  # the config of the model being built (quant_config_scope)


def current_quant_config() -> QuantizationConfig:
    """The config of the innermost ``quant_config_scope`` (``UNQUANTIZED`` outside any)."""
    return _QUANT_CONFIG


@contextlib.contextmanager
def quant_config_scope(config: QuantizationConfig | None) -> Iterator[None]:
    """Linears and FusedMoEs built inside the block take their method from ``config`` (None: unquantized)."""
    global _QUANT_CONFIG
    previous, _QUANT_CONFIG = _QUANT_CONFIG, config if config is not None else UNQUANTIZED
    try:
        yield
    finally:
        _QUANT_CONFIG = previous


def bind_quant_config(model: nn.Module, config: QuantizationConfig | None) -> None:
    """Name every method-holding layer of ``model`` (``layer.prefix``) and give it ``config``'s method for that
    name where it differs in type from the one it was built with (e.g. a router or an ignored layer back to
    float weights). Call after construction, before loading; ``config`` None only names the layers."""
    for name, module in model.named_modules():
        kind = getattr(module, "quant_kind", None)
        if kind is None:
            continue
        module.prefix = name
        if config is None:
            continue
        method = config.get_method(kind, name)
        if type(method) is not type(module.quant_method):
            module.set_quant_method(method)
