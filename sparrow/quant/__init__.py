"""Weight formats (``docs/architecture.md``, "Adding a format"): one module per format with its pack / unpack /
dequantize torch reference and its method objects, registered by name (``registry``); ``base`` says what a format
gives."""
from sparrow.quant.base import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
from sparrow.quant.scope import bind_quant_config, current_quant_config, quant_config_scope
from sparrow.quant.unquantized import UNQUANTIZED, UnquantizedConfig
from sparrow.quant.registry import (
    check_quantization,
    config_for_quantization,
    config_from_hf,
    get_quantization,
    register_quantization,
    supported_quantization,
)

__all__ = [
    "UNQUANTIZED", "FusedMoEMethodBase", "LinearMethodBase", "QuantizationConfig",
    "UnquantizedConfig", "bind_quant_config", "current_quant_config",
    "quant_config_scope", "check_quantization", "config_for_quantization", "config_from_hf", "get_quantization",
    "register_quantization", "supported_quantization",
]
