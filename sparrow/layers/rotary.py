"""Rotary position embedding (RoFormer, arXiv:2104.09864) in HF's rotate-half layout.

Shapes: R = rows, Hx = heads, D = head dim, Dr = rotary dim (<= D; the first Dr dims of each head rotate).
A cos/sin cache [P, Dr] (fp32, cos and sin each [P, Dr] with the two halves repeated, as HF builds
``emb = cat(freqs, freqs)``) is indexed by position.
Supported rope types: 'default', 'linear' (positions / factor), 'llama3' (Llama 3.1 frequency bands,
as transformers' ``_compute_llama3_parameters``), 'proportional' (Gemma 4 full layers, transformers'
``_compute_proportional_rope_parameters``: Dr = D, the first a = int(partial_rotary_factor * D // 2)
frequencies are theta^(-2i/D), the other D/2 - a are 0 (cos 1, sin 0), all / factor; rotate_half runs
over the whole head, so dims 0..a-1 pair with D/2..D/2+a-1).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from sparrow.errors import ModelLoadError


def rope_inv_freq(rotary_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """inv_freq [Dr/2] fp32 and the attention scaling factor for a rope parameter dict."""
    theta = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind == "proportional":
        angles = int(float(rope.get("partial_rotary_factor", 1.0)) * rotary_dim // 2)
        rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / rotary_dim))
        inv_freq = torch.cat([rotated, torch.zeros(rotary_dim // 2 - angles)])
        return inv_freq / float(rope.get("factor", 1.0)), 1.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "llama3":
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ModelLoadError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3, proportional)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


_CACHES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [R, Hq, D] and k [R, Hkv, D] at ``positions`` [R] (int64).

    The cos/sin tables are shared by every layer with the same rope parameters and grown on demand
    (``prepare(max_position, device)`` builds them up front, e.g. before CUDA-graph capture)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, rope: dict):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.rope = dict(rope)
        self.freq_factors: torch.Tensor | None = None
        self.max_position = max_position

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """llama.cpp's per-frequency divisors (GGUF ``rope_freqs``): inv_freq / factors."""
        self.freq_factors = factors.float().cpu()
        self.__dict__.pop("_tables", None)
        self.__dict__.pop("_kernel_cache", None)

    def _key(self, device) -> tuple:
        ff = None if self.freq_factors is None else tuple(self.freq_factors.tolist())
        return (self.rotary_dim, tuple(sorted((k, str(v)) for k, v in self.rope.items())), ff, str(device))

    def prepare(self, max_position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._key(device)
        cached = _CACHES.get(key)
        if cached is not None and cached[0].shape[0] >= max_position:
            return cached
        n = 1 << max(12, (max_position - 1).bit_length())
        inv_freq, scaling = rope_inv_freq(self.rotary_dim, self.rope)
        if self.freq_factors is not None:
            inv_freq = inv_freq / self.freq_factors
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cached = ((emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device))
        _CACHES[key] = cached
        return cached

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

    def _device_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self.__dict__.get("_tables")
        if tables is None or tables[0].device != device:
            tables = self.prepare(self.max_position, device)
            self.__dict__["_tables"] = tables  # plain attribute: not a buffer, not in state_dict
        return tables

    def cos_sin_cache(self, device) -> torch.Tensor:
        """[P, Dr] fp32 ``[cos | sin]`` (each Dr/2 wide), the table layout of the fused Triton kernel
        ``sparrow.kernels.norm_rope.rope.qk_norm_rope_kv_write``; built once per device and rope parameters."""
        cache = self.__dict__.get("_kernel_cache")
        if cache is None or cache.device != torch.device(device):
            cos, sin = self._device_tables(device)
            key = ("kernel",) + self._key(device)
            cache = _CACHES.get(key)
            if cache is None or cache.shape[0] != cos.shape[0]:
                half = self.rotary_dim // 2
                cache = torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()
                _CACHES[key] = cache
            self.__dict__["_kernel_cache"] = cache
        return cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos_cache, sin_cache = self._device_tables(q.device)
        cos = cos_cache[positions].to(q.dtype)[:, None, :]
        sin = sin_cache[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
