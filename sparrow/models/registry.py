"""HF architecture name -> sparrow model class. The name table is
``sparrow.config.architectures.ARCHITECTURES`` (``ModelConfig.from_hf`` resolves names against it); this module
imports the class a name maps to."""
from __future__ import annotations

import importlib

from sparrow.config.architectures import ARCHITECTURES, register, resolve_architecture, supported_architectures
from sparrow.errors import UnsupportedArchitectureError

__all__ = ["get_model_class", "register", "resolve_architecture", "supported_architectures"]


def get_model_class(architecture: str):
    """The nn.Module class for an HF architecture name."""
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture}; supported: {', '.join(supported_architectures())}"
        )
    module, cls = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"sparrow.models.{module}"), cls)
