"""Gated activations of a fused gate|up projection (``act``)."""
