"""FP8 (e4m3) quantize / dequantize references: the oracle of every kernel that emits or reads FP8.

Shapes: R = rows, H = hidden (columns), G = ceil(H / group) groups per row, N x K = weight (out x in).

Two layouts:
- activations: per row, per group of ``group`` (128) consecutive columns, one fp32 scale
  ``amax(|x|) / 448`` (448 = largest finite e4m3); q = x / scale, saturated to +-448, rounded to nearest.
  Same formula as DeepSeek-V3's ``act_quant`` and vLLM's ``per_token_group_quant_fp8``; like vLLM the amax
  is clamped at ``AMAX_EPS`` so an all-zero group gets a tiny positive scale and q = 0 (never 0/0).
- weights: one fp32 scale per [128, 128] block (``weight_scale_inv`` of DeepSeek / Qwen FP8
  checkpoints): w = q * scale[n // 128, k // 128].
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_EPS = 1e-10
GROUP = 128


def quantize_fp8_per_group_ref(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [R, H] (any float dtype) to (q e4m3 [R, H], scales fp32 [R, ceil(H / group)]).

    scale = max(amax(|x| over the group, in fp32), AMAX_EPS) / 448; q = clamp(x / scale, -448, 448).
    A ragged last group (H % group != 0) gets its own scale over its H % group columns.
    Raises ValueError unless x is 2-D floating point.
    """
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize_fp8_per_group_ref: x must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    rows, hidden = x.shape
    groups = -(-hidden // group)
    xf = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    xf[:, :hidden] = x.float()
    xg = xf.view(rows, groups, group)
    scales = xg.abs().amax(dim=-1).clamp_min(AMAX_EPS) / FP8_MAX  # [R, G]
    q = (xg / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, groups * group)[:, :hidden].contiguous(), scales


def dequantize_fp8_per_group_ref(q: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Inverse of ``quantize_fp8_per_group_ref``: q [R, H] e4m3, scales [R, ceil(H / group)] -> fp32 [R, H]."""
    hidden = q.shape[1]
    return q.float() * scales.float().repeat_interleave(group, dim=1)[:, :hidden]


# The brief's short name for the activation dequantizer.
dequantize = dequantize_fp8_per_group_ref


def quantize_fp8_block_ref(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight w [N, K] to (q e4m3 [N, K], scales fp32 [ceil(N / block), ceil(K / block)]),
    one scale = max(amax, AMAX_EPS) / 448 per [block, block] tile (DeepSeek-V3 ``weight_scale_inv``)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_block_ref: w must be a 2-D float tensor, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wf = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    wf[:n, :k] = w.float()
    tiles = wf.view(nb, block, kb, block)
    scales = tiles.abs().amax(dim=(1, 3)).clamp_min(AMAX_EPS) / FP8_MAX  # [nb, kb]
    q = (tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scales


def dequantize_fp8_block_ref(q: torch.Tensor, scales: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    """Inverse of ``quantize_fp8_block_ref``: q [N, K] e4m3, scales [ceil(N/block), ceil(K/block)] -> fp32 [N, K]."""
    n, k = q.shape
    full = scales.float().repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return q.float() * full
