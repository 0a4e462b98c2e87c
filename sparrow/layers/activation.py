"""Gated activations by HF name, for the layers and the config check: ``ACTIVATIONS`` and
``get_activation`` are those of ``sparrow.kernels.activation.act``, where the torch twins and the Triton kernels live
(x [..., 2I] = [gate | up] -> act(gate) * up [..., I] in x's dtype)."""
from __future__ import annotations

from sparrow.kernels.activation.act import ACTIVATIONS, act_and_mul, get_activation

__all__ = ["ACTIVATIONS", "act_and_mul", "get_activation"]
