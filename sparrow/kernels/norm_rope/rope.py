"""Fused per-head q/k RMSNorm + RoPE + paged K/V write: torch twin, Triton launcher, cos/sin table.

Shapes: R = rows, Hq / Hkv = query / KV heads, D = head dim of q and k, Dv = head dim of v, RD = rotary
dim (even, <= D), N = pages, B = page size. Cache layout as paged_attention.py (slot = page * B + offset).

RoPE is the neox / HF ``rotate_half`` form over the first RD dims of each head: with h = RD // 2,
``y[i] = x[i] cos_i - x[i+h] sin_i`` and ``y[i+h] = x[i+h] cos_i + x[i] sin_i`` for i < h; dims RD..D-1
pass through. cos_sin_cache[pos] = [cos(pos * inv_freq) | sin(pos * inv_freq)], fp32, [max_pos, RD].

Partial rotary comes in two forms, both expressed with this one kernel through ``build_cos_sin_cache``:
- GPT-NeoX / Phi / GLM style (``partial_rotary_factor``, HF "default" rope): RD = factor * D, the first RD
  dims rotate in pairs (i, i + RD/2), inv_freq_i = theta^(-2i / RD).
- Gemma 4 "proportional" (transformers ``_compute_proportional_rope_parameters``): inv_freq has D / 2
  entries, the first ``a = int(factor * D // 2)`` are theta^(-2i / D) (denominator D, not RD) and the rest
  are 0, and ``rotate_half`` runs over the *whole* head, pairing i with i + D/2. So the rotated dims are
  0..a-1 and D/2..D/2+a-1 (for D = 512, factor 0.25: 0..63 and 256..319), not the first 25 %. Use
  RD = D with ``build_cos_sin_cache(D, max_pos, theta, freq_dim=D, rotated_pairs=a)``: the zero
  frequencies give cos = 1, sin = 0, which is exactly HF.

Norms are per-head RMSNorm, statistics in fp32: ``gemma_norm`` gives ``(x * rstd * (norm_offset + w))``
in fp32, cast once (HF Gemma3RMSNorm with norm_offset = 1; Gemma4RMSNorm multiplies by w itself, so pass
norm_offset = 0 for Gemma 4); otherwise ``w * (x * rstd).to(dtype)`` (HF LlamaRMSNorm / Qwen3). RoPE is
computed in fp32 from the normed (rounded) values and rounded once; HF rounds cos/sin and each product
to the activation dtype, so bf16 results can differ from HF by about one bf16 ulp (fp32 is exact).
"""
from __future__ import annotations

import torch
import triton

from sparrow.kernels.norm_rope._rope_jit import qk_norm_rope_kv_write_kernel
from sparrow.kernels import interpreting, pdl_kwargs, use_triton
from sparrow.kernels.attention.paged_attention import _scale_args, write_kv_ref


def build_cos_sin_cache(
    rotary_dim: int,
    max_pos: int,
    theta: float,
    *,
    freq_dim: int | None = None,
    rotated_pairs: int | None = None,
    inv_freq: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_pos, rotary_dim] fp32 table of [cos | sin] for positions 0..max_pos-1.

    inv_freq [rotary_dim // 2] if given (e.g. from transformers' ROPE_INIT_FUNCTIONS for scaled rope types),
    else ``inv_freq_i = theta ** (-2i / freq_dim)`` for i < rotated_pairs and 0 after (freq_dim defaults to
    rotary_dim, rotated_pairs to rotary_dim // 2; see the module doc for Gemma 4 "proportional").
    Angles are ``pos.float() * inv_freq`` in fp32, as HF's rotary embedding computes them.
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    half = rotary_dim // 2
    if inv_freq is None:
        freq_dim = freq_dim or rotary_dim
        pairs = half if rotated_pairs is None else rotated_pairs
        if not 0 <= pairs <= half:
            raise ValueError(f"rotated_pairs {pairs} outside 0..{half}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.int64).float() / freq_dim))
        inv_freq = torch.cat([inv_freq, torch.zeros(half - pairs)])
    if inv_freq.shape != (half,):
        raise ValueError(f"inv_freq has shape {tuple(inv_freq.shape)}, expected ({half},)")
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def qk_norm_rope_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    gemma_norm: bool,
    v_norm: bool,
    k_eq_v: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    norm_offset: float = 1.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``qk_norm_rope_kv_write`` (same arguments and results; see that docstring)."""
    half = rotary_dim // 2
    cs = cos_sin_cache[positions].float()  # [R, RD]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is None:
            return x
        if gemma_norm:
            return (_rms(x, eps) * (norm_offset + w.float())).to(x.dtype)
        return (w.float() * _rms(x, eps).to(x.dtype).float()).to(x.dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rotary_dim:]], dim=-1).to(x.dtype)

    q_out = rope(norm(q, q_norm_weight))
    k_out = rope(norm(k, k_norm_weight))
    vv = k if k_eq_v else v
    if v_norm:
        vv = _rms(vv, eps).to(vv.dtype)
    write_kv_ref(k_out, vv, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_out, k_out


def _check(q, k, v, positions, cos_sin_cache, rotary_dim, qw, kw, k_eq_v, k_cache, v_cache, slot_mapping):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"want q [R, Hq, D] and k [R, Hkv, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    rows, hkv, d = k.shape
    if k_eq_v != (v is None):
        raise ValueError("k_eq_v=True needs v=None (V is taken from k), and k_eq_v=False needs v")
    dv = d if v is None else v.shape[2]
    if v is not None and (v.dim() != 3 or tuple(v.shape[:2]) != (rows, hkv)):
        raise ValueError(f"v {tuple(v.shape)} does not match k {tuple(k.shape)}")
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (hkv, d):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} is not [N, B, {hkv}, {d}]")
    if v_cache.dim() != 4 or tuple(v_cache.shape[2:]) != (hkv, dv) or v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} is not [N, B, {hkv}, {dv}]")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(3) != 1 or c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"{name} needs contiguous pages (stride(0) == B * stride(1)) and a contiguous head dim")
    if rotary_dim % 2 or not 2 <= rotary_dim <= d or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even, <= D {d}, and match cos_sin_cache "
                         f"{tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous fp32")
    for name, w in (("q_norm_weight", qw), ("k_norm_weight", kw)):
        if w is not None and tuple(w.shape) != (d,):
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected ({d},)")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(t.shape) != (rows,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{rows}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and t.stride(2) != 1:
            raise ValueError(f"{name} needs a contiguous head dim")


def qk_norm_rope_kv_write(q, k, v, positions, cos_sin_cache, rotary_dim, q_norm_weight, k_norm_weight, eps,
                          gemma_norm, v_norm, k_eq_v, k_cache, v_cache, slot_mapping, *, norm_offset=1.0,
                          k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm, RoPE, and the write of K / V into the paged cache, in one kernel (the parameter
    types: ``qk_norm_rope_kv_write_ref``).

    q [R, Hq, D], k [R, Hkv, D], v [R, Hkv, Dv] or None (k_eq_v), same float dtype; positions [R] int64;
    cos_sin_cache [max_pos, RD] fp32 (``build_cos_sin_cache``); q/k_norm_weight [D] or None (no norm);
    gemma_norm / norm_offset: norm flavour (module doc); v_norm: scale-free RMSNorm on V; k_eq_v: V is the
    raw k (before k-norm and RoPE), then v-norm. k_cache [N, B, Hkv, D], v_cache [N, B, Hkv, Dv] receive
    the final K and V at slot_mapping [R] int64 (rows with slot < 0 are not written), cast to the cache dtype
    (FP8 e4m3 pools: divided by k_scale / v_scale, [1] fp32, saturated, rounded: ``quantize_kv_ref``).
    Returns (q_out [R, Hq, D], k_out [R, Hkv, D]) in q's dtype. Runs the Triton kernel on CUDA (or under
    ``sparrow.kernels.backend("triton")``), else the torch twin. Raises ValueError on bad shapes/dtypes.
    """
    args = (q, k, v, positions, cos_sin_cache, rotary_dim, q_norm_weight, k_norm_weight, eps, gemma_norm,
            v_norm, k_eq_v, k_cache, v_cache, slot_mapping)
    _check(q, k, v, positions, cos_sin_cache, rotary_dim, q_norm_weight, k_norm_weight, k_eq_v, k_cache, v_cache,
           slot_mapping)
    if not use_triton(q):
        return qk_norm_rope_kv_write_ref(*args, norm_offset=norm_offset, k_scale=k_scale, v_scale=v_scale)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    ks, vs, fp8 = _scale_args(k_cache, k_scale, v_scale)
    rows, hq, d = q.shape
    hkv = k.shape[1]
    dv = v_cache.shape[3]
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if rows == 0:
        return q_out, k_out
    half = rotary_dim // 2
    vv = k if v is None else v
    qw = q_norm_weight if q_norm_weight is not None else q
    kw = k_norm_weight if k_norm_weight is not None else k
    qk_norm_rope_kv_write_kernel[(rows, hq + hkv)](
        q, k, vv, positions, cos_sin_cache, qw, kw, q_out, k_out, k_cache, v_cache, slot_mapping, ks, vs,
        float(norm_offset), float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=hq, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), DV=dv, DV_PAD=triton.next_power_of_2(dv),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        PASS_PAD=triton.next_power_of_2(d - rotary_dim) if d > rotary_dim else 0,
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None, GEMMA=bool(gemma_norm),
        V_NORM=bool(v_norm), K_EQ_V=bool(k_eq_v), KV_FP8=fp8, EMULATE_FP8=fp8 and interpreting(),
        num_warps=4 if d <= 256 else 8, **pdl_kwargs(q),
    )
    return q_out, k_out
