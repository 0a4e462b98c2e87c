"""A checkpoint's FP8 KV-cache scales: per-tensor ``k_scale`` / ``v_scale`` of each attention layer, as
compressed-tensors (``model.layers.{i}.self_attn.k_scale`` / ``v_scale``, with ``kv_cache_scheme``) and ModelOpt
(``model.layers.{i}.self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, with ``kv_cache_quant_algo``) export them.

The loader hands them here instead of loading them as weights; each attention layer keeps its pair as
``Attention.checkpoint_kv_scales`` and ``sparrow.kv_cache.KVCache`` sets them on its FP8 layers (a model-dtype cache
ignores them). The scale is the dequantization factor, stored = x / scale (vLLM's reading).
"""
from __future__ import annotations

import re

import torch

from sparrow.errors import ModelLoadError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def bind_checkpoint_kv_scales(model, tensors: dict[str, torch.Tensor]) -> int:
    """Give each attention layer of ``model`` the k_scale / v_scale of ``tensors`` (checkpoint name -> scalar
    tensor) whose name holds its decoder layer index; a missing one of a pair stays 1.0. Returns the number of
    layers bound. Raises ModelLoadError for a scale that names no attention layer or holds more than one value."""
    from sparrow.layers.attention import Attention

    by_layer = {}
    for name, mod in model.named_modules():
        m = _LAYER.search(name)
        if isinstance(mod, Attention) and m:
            by_layer[int(m.group(1))] = mod
    pairs: dict[int, list] = {}
    for name, t in tensors.items():
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) not in by_layer:
            raise ModelLoadError(f"KV-cache scale {name!r} names no attention layer of the model")
        if t.numel() != 1:
            raise ModelLoadError(f"KV-cache scale {name!r} has shape {tuple(t.shape)}; a per-tensor one has one value")
        pair = pairs.setdefault(int(m.group(1)), [1.0, 1.0])
        pair[0 if name.endswith("k_scale") else 1] = float(t.float().reshape(-1)[0])
    for i, (k, v) in pairs.items():
        by_layer[i].checkpoint_kv_scales = (k, v)
    return len(pairs)
