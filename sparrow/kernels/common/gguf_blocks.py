"""GGUF (ggml) block dequantization in torch: the torch twin of the GGUF kernels (dense and expert) and the
dequantizing path of ``quantization=`` on a GGUF file.

Format source: the block structs in ggml's `ggml-common.h` (block_q4_0 ... block_q6_K) and the reference
`dequantize_row_*` functions in `ggml-quants.c`; gguf-py's `gguf/quants.py` is the bit-exact test oracle.
Every function here is pure torch over all blocks at once, so it runs unchanged on CPU and CUDA tensors.
Multi-byte fields are little-endian; `d` / `dmin` / `m` are IEEE fp16. The float operations are done in
the same order as ggml (scale products first, then `dl * q - ml`), which makes the result bit-exact.

Shapes: N = blocks, T = bytes per block, B = elements per block (32, or QK_K = 256 for the K-quants),
S = sub-blocks of a K-quant super-block (8 of 32 or 16 of 16 elements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from sparrow.errors import ModelLoadError, UnsupportedGGUFTypeError

# Elements dequantized per chain of ops: bounds the temporaries (~10 bytes an element) for huge tensors.
# Small chunks stay in the CPU caches; on a GPU big chunks keep kernel launches few.
_CHUNK_ELEMS = {"cpu": 1 << 21, "cuda": 1 << 26}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block: (N, T) uint8 -> (N, 1) float32."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _shifts(step: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """uint8 [count] = 0, step, 2 step, ... on like's device, made on the device (no host copy: a CUDA graph
    may capture it, as the GGUF embedding's row lookup does)."""
    return torch.arange(0, step * count, step, dtype=torch.uint8, device=like.device)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """(N, k*group) uint8 -> (N, k*2*group): each run of `group` bytes gives its low nibbles, then its high."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts(4, 2, qs).view(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _crumbs(qs: torch.Tensor, group: int) -> torch.Tensor:
    """(N, k*group) uint8 -> (N, k*4*group): each run of `group` bytes gives bits 0-1, 2-3, 4-5, 6-7."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts(2, 4, qs).view(1, 1, 4, 1)
    return (q & 0x03).reshape(n, -1)


def _bit_planes(qh: torch.Tensor) -> torch.Tensor:
    """(N, k) uint8 -> (N, 8*k): bit b of byte j goes to element b*k + j (K-quant high-bit masks)."""
    n = qh.shape[0]
    return ((qh.reshape(n, 1, -1) >> _shifts(1, 8, qh).view(1, 8, 1)) & 1).reshape(n, -1)


def _bits_le(qh: torch.Tensor) -> torch.Tensor:
    """(N, 4) uint8 holding a little-endian uint32 -> (N, 32): element j is bit j (Q5_0 / Q5_1 `qh`)."""
    n = qh.shape[0]
    return ((qh.reshape(n, -1, 1) >> _shifts(1, 8, qh).view(1, 1, 8)) & 1).reshape(n, -1)


# --- 32-element blocks (ggml-common.h: block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0) ---

def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # d: fp16 | qs[16]: element i < 16 is qs[i] & 0xF, element 16 + i is qs[i] >> 4; y = d * (q - 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:], 16).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # d: fp16 | m: fp16 | qs[16]; y = d * q + m
    return _f16(b, 0) * _nibbles(b[:, 4:], 16).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # d: fp16 | qh: uint32, bit j = 5th bit of element j | qs[16] as in Q4_0; y = d * (q - 16)
    q = _nibbles(b[:, 6:], 16) | (_bits_le(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # d: fp16 | m: fp16 | qh: uint32 | qs[16]; y = d * q + m
    q = _nibbles(b[:, 8:], 16) | (_bits_le(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # d: fp16 | qs: int8[32]; y = d * q
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


# --- 256-element super-blocks (ggml-common.h: block_q2_K ... block_q6_K, QK_K = 256) ---

def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16]: low nibble scale, high nibble min, per 16 elements | qs[64]: 2-bit, in two runs of 32
    # bytes, each giving bit pairs 0-1, 2-3, 4-5, 6-7 for 32 elements | d: fp16 | dmin: fp16
    n = b.shape[0]
    sc = b[:, :16]
    dl = (_f16(b, 80) * (sc & 0x0F).float()).unsqueeze(-1)  # (N, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = _crumbs(b[:, 16:80], 32).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32]: bit plane b of it holds the 3rd bit of elements 32b..32b+31 (set means "no -4") |
    # qs[64]: low 2 bits as in Q2_K | scales[12]: 16 6-bit signed (-32) scales | d: fp16
    n = b.shape[0]
    sc = b[:, 96:108]
    low = torch.cat((sc[:, :8] & 0x0F, sc[:, :8] >> 4), dim=1)  # scale i: low 4 bits
    high = ((sc[:, 8:12].reshape(n, 1, 4) >> _shifts(2, 4, b).view(1, 4, 1)) & 0x03).reshape(n, 16)
    dl = (_f16(b, 108) * ((low | (high << 4)).float() - 32)).unsqueeze(-1)  # (N, 16, 1)
    ql = _crumbs(b[:, 32:96], 32).to(torch.int8)
    qh = ((_bit_planes(b[:, :32]) ^ 1) << 2).to(torch.int8)
    q = (ql - qh).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, 256)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 6-bit scales and 8 6-bit mins (ggml get_scale_min_k4): bytes 0-3 / 4-7 hold scales /
    mins 0-3 in their low 6 bits and the top 2 bits of scales / mins 4-7; bytes 8-11 hold the low 4 bits
    of scales 4-7 (low nibble) and mins 4-7 (high nibble). (N, 12) uint8 -> 2 x (N, 8) float32."""
    a, m, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (c >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d: fp16 | dmin: fp16 | scales[12] | qs[128]: runs of 32 bytes, low nibbles then high, 8 x 32 elements
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (_f16(b, 0) * sc).unsqueeze(-1)  # (N, 8, 1)
    ml = (_f16(b, 2) * mn).unsqueeze(-1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # as Q4_K, with qh[32] (bytes 16-47) before qs: bit plane b is the 5th bit of sub-block b
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (_f16(b, 0) * sc).unsqueeze(-1)
    ml = (_f16(b, 2) * mn).unsqueeze(-1)
    q = _nibbles(b[:, 48:], 32) | (_bit_planes(b[:, 16:48]) << 4)
    return (dl * q.reshape(n, 8, 32).float() - ml).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128]: two halves of 64 bytes, low nibbles then high | qh[64]: two halves of 32 bytes, bit pairs
    # 0-1 .. 6-7 | scales: int8[16] per 16 elements | d: fp16; y = d * scale * (q - 32)
    n = b.shape[0]
    q = _nibbles(b[:, :128], 64) | (_crumbs(b[:, 128:192], 32) << 4)
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # (N, 16, 1)
    return (dl * (q.reshape(n, 16, 16).float() - 32)).reshape(n, 256)


_BLOCK_FNS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

SUPPORTED_TYPES: frozenset[T] = frozenset(_FLOAT_DTYPES) | frozenset(_BLOCK_FNS)
"""ggml types `dequantize` accepts."""


def _type_name(ggml_type: int) -> str:
    try:
        return T(ggml_type).name
    except ValueError:
        return f"unknown ggml type {int(ggml_type)}"


def block_bytes(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of any ggml type gguf-py knows, e.g. Q4_K -> (256, 144), F32 ->
    (1, 4). Raises UnsupportedGGUFTypeError for a type number gguf-py does not know."""
    try:
        return GGML_QUANT_SIZES[T(ggml_type)]
    except (ValueError, KeyError):
        raise UnsupportedGGUFTypeError(f"{_type_name(ggml_type)} has no known GGUF block size") from None


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], name: str = "") -> torch.Tensor:
    """Dequantize one GGUF tensor to float32.

    raw: the tensor's bytes exactly as stored in the file, as uint8 of any shape (flattened; a tensor of
      another dtype is reinterpreted as its bytes), on CPU or CUDA.
    ggml_type: a `gguf.GGMLQuantizationType` value, one of SUPPORTED_TYPES.
    shape: the logical row-major shape (GGUF's `ne` reversed), so blocks run along the last dim.
    name: the tensor's name, used in error messages.
    Returns a new float32 tensor of `shape` on raw's device, bit-exact with ggml / gguf-py.
    Raises UnsupportedGGUFTypeError (naming the type and the tensor) for a type outside SUPPORTED_TYPES,
    ModelLoadError if the byte count or the last dim does not fit the type's blocks.
    """
    type_name = _type_name(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedGGUFTypeError(
            f"GGUF tensor {name!r} uses ggml type {type_name}, which sparrow cannot dequantize "
            f"(supported: {supported})")
    qtype = T(ggml_type)
    block_elems, type_bytes = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    if block_elems > 1 and (not shape or shape[-1] % block_elems):
        raise ModelLoadError(
            f"GGUF tensor {name!r} of shape {shape}: {type_name} needs a last dim that is a multiple of "
            f"{block_elems}")
    flat = raw.contiguous().reshape(-1)
    flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    n_blocks = numel // block_elems
    if flat.numel() != n_blocks * type_bytes:
        raise ModelLoadError(
            f"GGUF tensor {name!r} ({type_name}, shape {shape}) should hold {n_blocks * type_bytes} bytes, "
            f"found {flat.numel()}")

    if qtype in _FLOAT_DTYPES:
        # a view needs an element-aligned storage offset; a copy fixes an odd slice of a bigger buffer
        flat = flat if flat.storage_offset() % type_bytes == 0 else flat.clone()
        return flat.view(_FLOAT_DTYPES[qtype]).to(torch.float32, copy=True).reshape(shape)

    fn = _BLOCK_FNS[qtype]
    blocks = flat.view(n_blocks, type_bytes)
    out = torch.empty(n_blocks, block_elems, dtype=torch.float32, device=raw.device)
    step = max(1, _CHUNK_ELEMS.get(raw.device.type, 1 << 21) // block_elems)
    for i in range(0, n_blocks, step):  # chunks of many blocks, only to bound the temporaries
        out[i:i + step] = fn(blocks[i:i + step])
    return out.reshape(shape)
