"""The paged KV cache: one ``LayerKVCache`` per attention layer (its K / V pools, dtype and FP8 scales), held by
a ``KVCache`` that owns the storage dtype of each layer, the per-layer shapes, the allocation and the scales.

Shapes: N = blocks in the pool (plus one pad block the block manager never hands out: CUDA-graph padding rows
write there), B = block size, Hkv = KV heads of the layer, D / Dv = its K / V head dims (Gemma 4: 256 on sliding
layers, 512 on full ones), R = rows of a step.

Layout (per layer): k [N + 1, B, Hkv, D], v [N + 1, B, Hkv, Dv]; token t of a sequence sits at slot
``block * B + offset`` (``sparrow.kernels.attention.paged_attention``).

Storage dtypes (vLLM's ``kv_cache_dtype`` names): "auto" stores K / V in the model dtype; "fp8" and "fp8_e4m3"
store e4m3 (``torch.float8_e4m3fn``) with one fp32 scale per layer for K and one for V: a write stores
``clamp(x / scale, -448, 448)`` rounded to nearest, a read ``stored * scale``, both inside the kernels. The scales
are [1] fp32 tensors on the device, updated in place, so captured CUDA graphs read the current values. They are
1.0 unless set: from the checkpoint's k_scale / v_scale (``set_scales``), or measured on the first prefill
(``calculate_scales``: amax / 448 of each layer's K and V). ``skip_layers`` keeps chosen layers in the model
dtype: "sliding_window" (every sliding-window layer) and / or attention-layer indices.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from sparrow.config.values import KV_CACHE_DTYPES, check_kv_cache_dtype, parse_skip_layers  # noqa: F401  (re-exported)
from sparrow.errors import InvalidRequestError
from sparrow.kernels.attention.paged_attention import FP8_KV_DTYPE, FP8_KV_MAX, write_kv

SCALE_EPS = 1e-8
"""Smallest measured scale (an all-zero layer would otherwise get scale 0)."""


def layer_kv_dtype(model_dtype: torch.dtype, kv_cache_dtype: str, index: int, sliding_window: int | None,
                   skip_layers: tuple = ()) -> torch.dtype:
    """Storage dtype of attention layer ``index`` (its window ``sliding_window``)."""
    if check_kv_cache_dtype(kv_cache_dtype) == "auto" or index in skip_layers:
        return model_dtype
    if sliding_window is not None and "sliding_window" in skip_layers:
        return model_dtype
    return FP8_KV_DTYPE


def kv_bytes_per_token(model, dtype: torch.dtype, kv_cache_dtype: str = "auto", skip_layers=()) -> int:
    """Bytes of K and V one token occupies over all attention layers of ``model`` (model dtype ``dtype``): 1 per
    element in FP8 layers, the model dtype's size in the others."""
    skip = parse_skip_layers(skip_layers)
    total = 0
    for i, a in enumerate(model.attention_layers()):
        size = torch.tensor([], dtype=layer_kv_dtype(dtype, kv_cache_dtype, i, a.sliding_window, skip)).element_size()
        total += a.num_kv_heads * (a.head_dim + a.v_head_dim) * size
    return total


class LayerKVCache:
    """One attention layer's pools: ``k`` [N + 1, B, Hkv, D], ``v`` [N + 1, B, Hkv, Dv] of ``dtype``, and its
    per-tensor ``k_scale`` / ``v_scale`` ([1] fp32 on the pools' device; read by the kernels for FP8 pools only).
    ``write`` stores a step's K / V; the attention kernels read ``k``, ``v`` and the scales."""

    def __init__(self, index: int, k: torch.Tensor, v: torch.Tensor):
        self.index = index
        """Position of the layer among the model's attention layers."""
        self.k, self.v = k, v
        self.dtype = k.dtype
        self.k_scale = torch.ones(1, dtype=torch.float32, device=k.device)
        self.v_scale = torch.ones(1, dtype=torch.float32, device=k.device)
        self.measure = False
        """Set by ``KVCache.calculating_scales``: the next ``write`` measures the scales first."""

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_KV_DTYPE

    def scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) as Python floats (a host sync)."""
        return float(self.k_scale), float(self.v_scale)

    def set_scales(self, k_scale, v_scale) -> None:
        """Set the scales in place (floats or one-element tensors; the tensors the kernels and CUDA graphs read
        stay the same objects). Raises InvalidRequestError for a scale that is not finite and > 0."""
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            value = float(s.float().reshape(-1)[0]) if isinstance(s, torch.Tensor) else float(s)
            if not (value > 0 and value < float("inf")):
                raise InvalidRequestError(f"layer {self.index}: {name}={value} must be a finite number > 0")
        for dst, s in ((self.k_scale, k_scale), (self.v_scale, v_scale)):
            dst.copy_(torch.as_tensor(s, dtype=torch.float32).reshape(-1)[:1])

    def measure_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set the scales to amax(|k|) / 448 and amax(|v|) / 448 (at least SCALE_EPS), on the device (no host
        sync). k [R, Hkv, D], v [R, Hkv, Dv]."""
        for dst, x in ((self.k_scale, k), (self.v_scale, v)):
            amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
            dst.copy_((amax / FP8_KV_MAX).clamp_min(SCALE_EPS).reshape(1))

    def take_measure(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Measure the scales from this step's k / v if ``measure`` is set (FP8 layers only), then clear it."""
        if self.measure:
            self.measure = False
            if self.is_fp8:
                self.measure_scales(k, v)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k [R, Hkv, D] and v [R, Hkv, Dv] at ``slot_mapping`` [R] int64 (slots < 0 skipped): the Triton
        write kernel where ``sparrow.kernels.use_triton(k)``, else its torch twin (``paged_attention.write_kv``);
        FP8 pools divide by the scales and saturate."""
        self.take_measure(k, v)
        write_kv(k, v, self.k, self.v, slot_mapping, self.k_scale, self.v_scale)


class KVCache:
    """The paged KV pool of a model: ``layers[i]`` is the LayerKVCache of attention layer i (bound to the layer
    as ``attn.kv_cache``). ``num_blocks`` blocks of ``block_size`` tokens are handed out; one more, block
    ``pad_block``, is allocated for CUDA-graph padding rows. Raises InvalidRequestError for an unknown
    kv_cache_dtype or skip-layer entry."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 kv_cache_dtype: str = "auto", skip_layers=(), calculate_scales: bool = False):
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.skip_layers = parse_skip_layers(skip_layers)
        self.num_blocks, self.block_size, self.pad_block = num_blocks, block_size, num_blocks
        self.layers: list[LayerKVCache] = []
        for i, attn in enumerate(model.attention_layers()):
            cdt = layer_kv_dtype(dtype, self.kv_cache_dtype, i, attn.sliding_window, self.skip_layers)
            k = torch.zeros(num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim, dtype=cdt, device=device)
            v = torch.zeros(num_blocks + 1, block_size, attn.num_kv_heads, attn.v_head_dim, dtype=cdt, device=device)
            layer = LayerKVCache(i, k, v)
            ckpt = getattr(attn, "checkpoint_kv_scales", None)
            if ckpt is not None and layer.is_fp8:
                layer.set_scales(*ckpt)
            attn.kv_cache = layer
            self.layers.append(layer)
        self.scales_pending = bool(calculate_scales) and any(layer.is_fp8 for layer in self.layers)
        """calculate_kv_scales was asked and the first prefill has not measured them yet."""

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __iter__(self) -> Iterator[LayerKVCache]:
        return iter(self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies over all layers."""
        return sum((c.k[0, 0].numel() + c.v[0, 0].numel()) * c.k.element_size() for c in self.layers)

    def scales(self) -> list[tuple[float, float]]:
        """(k_scale, v_scale) of every layer (a host sync)."""
        return [c.scales() for c in self.layers]

    @contextlib.contextmanager
    def holding_scales(self):
        """Steps inside do not measure pending scales (the server's warm-up on random ids); they stay pending."""
        pending, self.scales_pending = self.scales_pending, False
        try:
            yield
        finally:
            self.scales_pending = pending

    @contextlib.contextmanager
    def calculating_scales(self, prefill: bool = True):
        """Around an eager forward: while scales are pending and the step computes prompt rows (``prefill``),
        each FP8 layer measures its scales from the K / V it writes (before writing them); then they are no
        longer pending. A no-op otherwise (decode steps, CUDA-graph capture and replay)."""
        measure = self.scales_pending and prefill
        for c in self.layers:
            c.measure = measure
        try:
            yield
        finally:
            for c in self.layers:
                c.measure = False
            if measure:
                self.scales_pending = False
