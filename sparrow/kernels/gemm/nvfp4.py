"""NVFP4 pack / unpack / quantize / dequantize references: the oracle of every kernel that reads NVFP4 weights.

Shapes: N x K = weight (out x in), G = K / 16 scale groups per row.

NVFP4 (NVIDIA's 4-bit float weights; the layouts of ModelOpt and compressed-tensors ``nvfp4-pack-quantized``):
- values: e2m1 (1 sign, 2 exponent, 1 mantissa bit): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. A code is the
  index of the magnitude (0..7) plus 8 for a negative sign; two codes per byte along K, the even column in
  the low nibble (``packed[n, j] = code[n, 2j] | code[n, 2j + 1] << 4``, ModelOpt's
  ``(q[..., 1::2] << 4) | q[..., 0::2]`` and compressed-tensors' ``pack_fp4_to_uint8``): packed uint8 [N, K/2];
- one e4m3 scale per 16 consecutive elements of a row: scale [N, G] float8_e4m3fn;
- one fp32 global scale per tensor, stored two ways:
  ModelOpt ``weight_scale_2`` = amax(|w|) / (6 * 448), w = e2m1 * (scale * weight_scale_2);
  compressed-tensors ``weight_global_scale`` = 6 * 448 / amax(|w|), w = e2m1 * (scale / weight_global_scale)
  (its ``_dequantize``: ``scale = scale / global_scale; x_q * scale``). ``divide_global`` picks the second.
Rounding to e2m1 is to nearest (``e2m1_codes_ref``); halfway values go to the even code in compressed-tensors
(|x| <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6)
and in ModelOpt except 2.5 and 3.5, which both go to 3; a negative value that rounds to 0 keeps its sign bit
(code 8) in both.

Quantizers (``quantize_nvfp4_ref``), each the formula of its library:
- ModelOpt (``NVFP4QTensor.quantize``): g2 = amax / 2688; scale = e4m3(max(group_amax / (6 * g2), 2^-9)),
  a zero group scale 1; codes = e2m1(w / (scale * g2)); a w whose g2 is 0 (all zeros) takes g2 = 1 (the
  formula's 0 / 0);
- compressed-tensors (its NVFP4 observer + ``calculate_qparams`` + ``NVFP4PackedCompressor.compress``):
  G = 2688 / max(amax, tiny); scale = e4m3(clamp(G * group_amax / 6, +-448)), a zero scale 0.125 (e4m3's eps);
  codes = e2m1(clamp(w / (scale / G), +-6)).
"""
from __future__ import annotations

import torch

GROUP = 16
"""Elements per e4m3 scale (along K)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_DTYPE = torch.float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code."""
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # midpoints between neighbouring magnitudes
_TIES_UP = {"even": (0.75, 1.75, 3.5), "modelopt": (0.75, 1.75, 2.5)}


def e2m1_codes_ref(x: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round x (any float dtype, already divided by its scales) to the nearest e2m1 value and return the codes
    (uint8 in [0, 16), same shape); |x| > 6 saturates to 6; the sign bit is set for x < 0 (a negative value
    that rounds to 0 gives code 8, -0.0 gives code 0). ``ties``: "even" rounds halfway values to the even
    code (compressed-tensors' ``cast_to_fp4``: 2.5 -> 2, 3.5 -> 4); "modelopt" as ModelOpt's ``_cast_fp4``
    (2.5 -> 3, 3.5 -> 3; the others to even). Raises ValueError for another ``ties``."""
    if ties not in _TIES_UP:
        raise ValueError(f"e2m1_codes_ref: ties must be one of {sorted(_TIES_UP)}, got {ties!r}")
    xf = x.float()
    mag = xf.abs()
    idx = torch.bucketize(mag, _BOUNDS.to(mag.device), right=False)  # the first bound >= |x|
    up = torch.zeros_like(mag, dtype=torch.bool)
    for b in _TIES_UP[ties]:  # halfway values that round to the upper neighbour
        up |= mag == b
    idx = idx + up.to(idx.dtype)
    return idx.to(torch.uint8) | ((xf < 0).to(torch.uint8) << 3)


def pack_nvfp4_ref(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (K even) -> packed uint8 [..., K/2], the even column in the low nibble. Raises
    ValueError for an odd K."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nvfp4_ref: the last dim must be even, got {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nvfp4_ref(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> codes uint8 [..., K]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_values_ref(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> the e2m1 values as fp32 [..., K]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return table[unpack_nvfp4_ref(packed).long()]


def dequantize_nvfp4_ref(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                         divide_global: bool = False) -> torch.Tensor:
    """packed uint8 [..., N, K/2], scale e4m3 [..., N, K/16], global_scale fp32 broadcastable to [..., N]
    (a scalar, or one per row: packed layers hold one per shard) -> fp32 [..., N, K]:
    w = e2m1 * (scale * global) (ModelOpt ``weight_scale_2``), or with ``divide_global``
    e2m1 * (scale / global) (compressed-tensors ``weight_global_scale``). Raises ValueError on mismatched shapes."""
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != k:
        raise ValueError(f"dequantize_nvfp4_ref: scale {tuple(scale.shape)} does not fit packed "
                         f"{tuple(packed.shape)} (one scale per {GROUP} of K = {k})")
    g = global_scale.float()
    g = g.reshape(*g.shape, 1) if g.dim() else g  # per row -> [..., N, 1]
    s = scale.float() / g if divide_global else scale.float() * g  # [..., N, G]
    v = e2m1_values_ref(packed).unflatten(-1, (k // GROUP, GROUP))
    return (v * s.unsqueeze(-1)).flatten(-2)


def _groups(w: torch.Tensor) -> torch.Tensor:
    if w.dim() < 2 or not w.is_floating_point() or w.shape[-1] % GROUP:
        raise ValueError(f"NVFP4 quantization needs a float weight [..., N, K] with K a multiple of {GROUP}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    return w.unflatten(-1, (w.shape[-1] // GROUP, GROUP))


def _chunk_rows(w: torch.Tensor) -> int:
    """Rows of w quantized at a time: ModelOpt's formula is row-wise once the global scale is known, so chunks give
    the same bytes while the fp32 temporaries stay small (``kernels.gemm.int4.QUANTIZE_CHUNK`` elements on a GPU,
    ``QUANTIZE_CHUNK_CPU`` on the CPU, where host memory bounds a load)."""
    from sparrow.kernels.gemm.int4 import QUANTIZE_CHUNK, QUANTIZE_CHUNK_CPU

    return max(1, (QUANTIZE_CHUNK if w.is_cuda else QUANTIZE_CHUNK_CPU) // w.shape[-1])


def _modelopt_rows(wg: torch.Tensor, g2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and e4m3 block scales of fp32 groups wg [..., N, G, 16] under the global scale g2 (ModelOpt)."""
    block = wg.abs().amax(dim=-1) / (E2M1_MAX * g2)
    block[block == 0] = 1.0
    scale = block.clamp_(min=2.0 ** -9).to(SCALE_DTYPE)
    x = wg / (scale.float() * g2).unsqueeze(-1)
    return pack_nvfp4_ref(e2m1_codes_ref(x.flatten(-2), ties="modelopt")), scale


def quantize_nvfp4_ref(w: torch.Tensor, convention: str = "modelopt",
                       out: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize one weight w [N, K] (float, K a multiple of 16) -> (packed uint8 [N, K/2], scale e4m3 [N, K/16],
    global fp32 [1]) by ``convention``'s formula (module doc): "modelopt" (global = ``weight_scale_2``) or
    "compressed-tensors" (global = ``weight_global_scale``, dequantize with ``divide_global=True``).
    ``out`` (modelopt only): (packed, scale) tensors of those shapes written chunk by chunk and returned, so a
    load holds no second copy of the codes. Raises ValueError for another convention or a shape / dtype the
    format cannot hold."""
    if convention == "modelopt":
        _groups(w)  # checks the shape
        chunks = w.split(_chunk_rows(w), dim=-2)
        amax = torch.stack([c.abs().amax() for c in chunks]).amax().float()  # exact in any float dtype
        g2 = amax / (E2M1_MAX * E4M3_MAX)
        g2 = torch.where(g2 > 0, g2, 1.0).reshape(1)  # all zeros (or all below 2688 x fp32's least): 0 / 0 else
        if out is None:
            out = (torch.empty(*w.shape[:-1], w.shape[-1] // 2, dtype=torch.uint8, device=w.device),
                   torch.empty(*w.shape[:-1], w.shape[-1] // GROUP, dtype=SCALE_DTYPE, device=w.device))
        start = 0
        for c in chunks:
            packed, scale = _modelopt_rows(_groups(c).float(), g2)
            out[0].narrow(-2, start, c.shape[-2]).copy_(packed)
            out[1].narrow(-2, start, c.shape[-2]).copy_(scale)
            start += c.shape[-2]
        return out[0], out[1], g2
    if out is not None:
        raise ValueError("quantize_nvfp4_ref: out= is the modelopt convention's")
    wg = _groups(w).float()  # [N, G, 16]
    if convention == "compressed-tensors":
        amax = wg.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
        gs = torch.nan_to_num(E4M3_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)
        block = gs * (wg.abs().amax(dim=-1) / E2M1_MAX)
        scale = block.clamp(-E4M3_MAX, E4M3_MAX).to(SCALE_DTYPE).float()
        scale = torch.where(scale == 0, torch.tensor(torch.finfo(SCALE_DTYPE).eps), scale).to(SCALE_DTYPE)
        x = (wg / (scale.float() / gs).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
        return pack_nvfp4_ref(e2m1_codes_ref(x.flatten(-2))), scale, gs
    raise ValueError(f"quantize_nvfp4_ref: convention must be 'modelopt' or 'compressed-tensors', got {convention!r}")
