"""Triton dequantizers of raw GGUF (ggml) blocks: a [BN, BK] fp32 tile of a GGUF weight, decoded in registers
from the packed bytes (the dense GGUF kernels, ``sparrow.kernels.gemm._gguf_jit``, and the routed GGUF experts
read them; the torch twin is ``sparrow.kernels.common.gguf_blocks``, bit-exact with gguf-py).

Format source: the block structs of ggml's ``ggml-common.h`` (block_q8_0 ... block_q6_K) and the reference
``dequantize_row_*`` of ``ggml-quants.c``; ``gguf_blocks.py`` documents each layout again next to its twin.

Weight layout (the contract of every GGUF kernel): a weight of logical shape [N, K] of ggml type t is uint8
[N, K // B * T] (B elements, T bytes per block), each row its blocks exactly as in the file. A row's first
byte is at ``w_ptr + row_off[n]``: expert offsets and row strides are the caller's.

    dequant_tile(w_ptr, row_off [BN] int64, offs_k [BK] int32, GGML_TYPE) -> fp32 [BN, BK]

``offs_k`` is BK // 32 runs of 32 consecutive element indices, each starting at a multiple of 32 (e.g.
``k0 + tl.arange(0, BK)`` with k0 a multiple of 32), all < K: a tail tile wraps (``offs_k % K``; K is a
multiple of the block, so a wrapped run is a whole group) and the caller zeroes its x. No load is masked:
rows past N need a valid ``row_off`` (clamp the row index).

Design: the tile is decoded per 32-element group (a Q*_0 / Q*_1 block, or one sub-block of a 256-element
K-quant super-block). Each group's bytes are loaded as contiguous runs built on ``tl.arange`` (16 or 32
bytes: vectorizable loads where the row offset's divisibility allows it), its scales once per group (or per
16-element half for Q2_K, Q3_K, Q6_K), and the decoded nibbles / bit pairs are put in element order by
``tl.join`` + ``tl.permute`` + ``tl.reshape`` (register moves). fp16 fields are two byte loads combined into
a uint16 and bitcast. Float operations follow the twin's order (scale products first, then ``dl * q - ml``);
the product before the add is ``_mul_rn`` (no FMA contraction on the GPU), so the tile is bit-exact with
``gguf_blocks.dequantize`` on the GPU as in the interpreter.
"""
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as _T
from triton.language.extra import libdevice

from sparrow import switches

_INTERPRET = tl.constexpr(switches.TRITON_INTERPRET)

Q4_0 = tl.constexpr(int(_T.Q4_0))
Q4_1 = tl.constexpr(int(_T.Q4_1))
Q5_0 = tl.constexpr(int(_T.Q5_0))
Q5_1 = tl.constexpr(int(_T.Q5_1))
Q8_0 = tl.constexpr(int(_T.Q8_0))
Q2_K = tl.constexpr(int(_T.Q2_K))
Q3_K = tl.constexpr(int(_T.Q3_K))
Q4_K = tl.constexpr(int(_T.Q4_K))
Q5_K = tl.constexpr(int(_T.Q5_K))
Q6_K = tl.constexpr(int(_T.Q6_K))


@triton.jit
def _mul_rn(a, b):
    """a * b rounded to fp32 on its own (never fused with a following add into an FMA, which would change
    the rounding of ``dl * q - ml``)."""
    if _INTERPRET:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def _f16(w_ptr, off):
    """The little-endian fp16 field at byte offsets ``off`` (any shape, int64) as fp32."""
    lo = tl.load(w_ptr + off).to(tl.uint16)
    hi = tl.load(w_ptr + off + 1).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _run(w_ptr, off, NB: tl.constexpr):
    """uint8 [BN, G, NB]: the NB contiguous bytes starting at each byte offset of ``off`` [BN, G] int64."""
    return tl.load(w_ptr + off[:, :, None] + tl.arange(0, NB)[None, None, :])


@triton.jit
def _cat(a, b):
    """[BN, G, H] and [BN, G, H] -> [BN, G, 2H]: a's H values, then b's, in each group."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 1, 3, 2)), [a.shape[0], a.shape[1], 2 * a.shape[2]])


@triton.jit
def _groups(row_off, offs_k, B: tl.constexpr, T: tl.constexpr):
    """(byte offset of each group's block [BN, G] int64, sub-block index [1, G] int32 of the group's 32
    elements inside a B-element block) for the G = BK // 32 groups of ``offs_k``."""
    G: tl.constexpr = offs_k.shape[0] // 32
    start = tl.min(tl.reshape(offs_k, [G, 32]), axis=1)
    blk = (start // B).to(tl.int64)
    return row_off[:, None] + (blk * T)[None, :], ((start % B) // 32)[None, :]


@triton.jit
def _flat(y, BN: tl.constexpr, BK: tl.constexpr):
    return tl.reshape(y, [BN, BK])


@triton.jit
def _nibbles16(w_ptr, qs_off):
    """[BN, G, 32] uint8: the low nibbles of 16 bytes at ``qs_off`` (elements 0-15), then their high nibbles."""
    qs = _run(w_ptr, qs_off, 16)
    return _cat(qs & 0x0F, qs >> 4)


@triton.jit
def _bits32(w_ptr, qh_off):
    """[BN, G, 32] uint8: bit j of the little-endian uint32 at ``qh_off`` as element j (Q5_0 / Q5_1 qh)."""
    qh = _run(w_ptr, qh_off, 4).to(tl.uint32) << (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, :]
    word = tl.sum(qh, axis=2)  # disjoint bytes: the sum is their OR
    return ((word[:, :, None] >> tl.arange(0, 32).to(tl.uint32)[None, None, :]) & 1).to(tl.uint8)


# --- 32-element blocks (ggml-common.h: block_q8_0, block_q4_0, block_q4_1, block_q5_0, block_q5_1) ---

@triton.jit
def dequant_q8_0(w_ptr, row_off, offs_k):
    """Q8_0 (34 bytes: d fp16 | qs int8[32]): y = q * d."""
    base, _ = _groups(row_off, offs_k, 32, 34)
    q = _run(w_ptr, base + 2, 32).to(tl.int8, bitcast=True).to(tl.float32)
    return _flat(q * _f16(w_ptr, base)[:, :, None], row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q4_0(w_ptr, row_off, offs_k):
    """Q4_0 (18 bytes: d fp16 | qs[16], element i < 16 the low nibble of qs[i], 16 + i its high): y = d (q - 8)."""
    base, _ = _groups(row_off, offs_k, 32, 18)
    q = _nibbles16(w_ptr, base + 2).to(tl.float32)
    return _flat(_f16(w_ptr, base)[:, :, None] * (q - 8.0), row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q4_1(w_ptr, row_off, offs_k):
    """Q4_1 (20 bytes: d fp16 | m fp16 | qs[16] as Q4_0): y = d q + m."""
    base, _ = _groups(row_off, offs_k, 32, 20)
    q = _nibbles16(w_ptr, base + 4).to(tl.float32)
    y = _mul_rn(_f16(w_ptr, base)[:, :, None], q) + _f16(w_ptr, base + 2)[:, :, None]
    return _flat(y, row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q5_0(w_ptr, row_off, offs_k):
    """Q5_0 (22 bytes: d fp16 | qh uint32, bit j the 5th bit of element j | qs[16] as Q4_0): y = d (q - 16)."""
    base, _ = _groups(row_off, offs_k, 32, 22)
    q = (_nibbles16(w_ptr, base + 6) | (_bits32(w_ptr, base + 2) << 4)).to(tl.float32)
    return _flat(_f16(w_ptr, base)[:, :, None] * (q - 16.0), row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q5_1(w_ptr, row_off, offs_k):
    """Q5_1 (24 bytes: d fp16 | m fp16 | qh uint32 | qs[16]): y = d q + m."""
    base, _ = _groups(row_off, offs_k, 32, 24)
    q = (_nibbles16(w_ptr, base + 8) | (_bits32(w_ptr, base + 4) << 4)).to(tl.float32)
    y = _mul_rn(_f16(w_ptr, base)[:, :, None], q) + _f16(w_ptr, base + 2)[:, :, None]
    return _flat(y, row_off.shape[0], offs_k.shape[0])


# --- 256-element super-blocks (ggml-common.h: block_q2_K ... block_q6_K); s = the group's sub-block 0..7 ---

@triton.jit
def _halves(v):
    """[BN, G, 32] -> [BN, G, 2, 16]: each group's two 16-element halves (the K-quants' 16-element scales)."""
    return tl.reshape(v, [v.shape[0], v.shape[1], 2, 16])


@triton.jit
def _crumbs(w_ptr, qs_off, s):
    """[BN, G, 32] uint8: the 2-bit values of sub-block s from qs at ``qs_off`` (Q2_K / Q3_K, ggml order: runs
    of 32 bytes, each giving bit pairs 0-1, 2-3, 4-5, 6-7 to 4 consecutive sub-blocks)."""
    qs = _run(w_ptr, qs_off + (s // 4) * 32, 32)
    return (qs >> ((s % 4) * 2).to(tl.uint8)[:, :, None]) & 0x03


@triton.jit
def _half_index(s):
    """[1, G, 2] int32: the index 2 s + h of each 16-element half's scale."""
    return 2 * s[:, :, None] + tl.arange(0, 2)[None, None, :]


@triton.jit
def dequant_q2_k(w_ptr, row_off, offs_k):
    """Q2_K (84 bytes: scales[16], low nibble scale and high nibble min per 16 elements | qs[64] | d fp16 |
    dmin fp16): y = (d sc) q - (dmin m)."""
    base, s = _groups(row_off, offs_k, 256, 84)
    q = _halves(_crumbs(w_ptr, base + 16, s).to(tl.float32))
    sc = tl.load(w_ptr + base[:, :, None] + _half_index(s))
    dl = _f16(w_ptr, base + 80)[:, :, None] * (sc & 0x0F).to(tl.float32)
    ml = _f16(w_ptr, base + 82)[:, :, None] * (sc >> 4).to(tl.float32)
    y = _mul_rn(dl[:, :, :, None], q) - ml[:, :, :, None]
    return _flat(y, row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q3_k(w_ptr, row_off, offs_k):
    """Q3_K (110 bytes: hmask[32], bit s of byte j the 3rd bit of element j of sub-block s, set meaning "no -4" |
    qs[64] low 2 bits as Q2_K | scales[12]: 16 6-bit scales, minus 32 | d fp16): y = (d (sc - 32)) q."""
    base, s = _groups(row_off, offs_k, 256, 110)
    hbit = (_run(w_ptr, base, 32) >> s.to(tl.uint8)[:, :, None]) & 1
    q = _crumbs(w_ptr, base + 32, s).to(tl.int8) - ((hbit ^ 1) << 2).to(tl.int8)
    i = _half_index(s)  # scale i: low 4 bits in byte i % 8 (nibble i // 8), high 2 in byte 8 + i % 4
    low = (tl.load(w_ptr + base[:, :, None] + 96 + i % 8) >> (4 * (i // 8)).to(tl.uint8)) & 0x0F
    high = (tl.load(w_ptr + base[:, :, None] + 104 + i % 4) >> (2 * (i // 4)).to(tl.uint8)) & 0x03
    dl = _f16(w_ptr, base + 108)[:, :, None] * ((low | (high << 4)).to(tl.float32) - 32.0)
    return _flat(dl[:, :, :, None] * _halves(q.to(tl.float32)), row_off.shape[0], offs_k.shape[0])


@triton.jit
def _scale_min_k4(w_ptr, base, s):
    """(scale, min) [BN, G] fp32 of sub-block s from the 12 scale bytes at base + 4 (ggml get_scale_min_k4):
    s < 4: the low 6 bits of bytes s and s + 4; s >= 4: the nibbles of byte s + 4 with the top 2 bits of bytes
    s - 4 and s."""
    lo = s < 4
    b_s = tl.load(w_ptr + base + 4 + s)
    b_s4 = tl.load(w_ptr + base + 8 + s)
    b_m4 = tl.load(w_ptr + base + 4 + tl.where(lo, s, s - 4))
    sc = tl.where(lo, b_s & 0x3F, (b_s4 & 0x0F) | ((b_m4 >> 2) & 0x30))
    mn = tl.where(lo, b_s4 & 0x3F, (b_s4 >> 4) | ((b_s >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k4_nibbles(w_ptr, qs_off, s):
    """[BN, G, 32] uint8: sub-block s of Q4_K / Q5_K qs (runs of 32 bytes: low nibbles, then high)."""
    qs = _run(w_ptr, qs_off + (s // 2) * 32, 32)
    return (qs >> ((s % 2) * 4).to(tl.uint8)[:, :, None]) & 0x0F


@triton.jit
def _dl_q_ml(w_ptr, base, s, q):
    """(d sc) q - (dmin m) of Q4_K / Q5_K: q [BN, G, 32] fp32 -> [BN, G, 32]."""
    sc, mn = _scale_min_k4(w_ptr, base, s)
    dl = _f16(w_ptr, base) * sc
    ml = _f16(w_ptr, base + 2) * mn
    return _mul_rn(dl[:, :, None], q) - ml[:, :, None]


@triton.jit
def dequant_q4_k(w_ptr, row_off, offs_k):
    """Q4_K (144 bytes: d fp16 | dmin fp16 | scales[12] | qs[128]): y = (d sc) q - (dmin m)."""
    base, s = _groups(row_off, offs_k, 256, 144)
    q = _k4_nibbles(w_ptr, base + 16, s).to(tl.float32)
    return _flat(_dl_q_ml(w_ptr, base, s, q), row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q5_k(w_ptr, row_off, offs_k):
    """Q5_K (176 bytes: as Q4_K with qh[32] at bytes 16-47, bit s of byte j the 5th bit of element j of
    sub-block s, and qs at 48)."""
    base, s = _groups(row_off, offs_k, 256, 176)
    hbit = (_run(w_ptr, base + 16, 32) >> s.to(tl.uint8)[:, :, None]) & 1
    q = (_k4_nibbles(w_ptr, base + 48, s) | (hbit << 4)).to(tl.float32)
    return _flat(_dl_q_ml(w_ptr, base, s, q), row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_q6_k(w_ptr, row_off, offs_k):
    """Q6_K (210 bytes: ql[128] | qh[64] | scales int8[16] per 16 elements | d fp16): sub-block s = 4 r + p
    takes the nibble p // 2 of ql[64 r + 32 (p % 2) + j] and bit pair p of qh[32 r + j];
    y = (d sc) (q - 32)."""
    base, s = _groups(row_off, offs_k, 256, 210)
    r, p = s // 4, s % 4
    ql = _run(w_ptr, base + r * 64 + (p % 2) * 32, 32)
    qh = _run(w_ptr, base + 128 + r * 32, 32)
    q = ((ql >> ((p // 2) * 4).to(tl.uint8)[:, :, None]) & 0x0F) | (
        ((qh >> (p * 2).to(tl.uint8)[:, :, None]) & 0x03) << 4)
    sc = tl.load(w_ptr + base[:, :, None] + 192 + _half_index(s)).to(tl.int8, bitcast=True)
    dl = _f16(w_ptr, base + 208)[:, :, None] * sc.to(tl.float32)
    return _flat(dl[:, :, :, None] * (_halves(q.to(tl.float32)) - 32.0), row_off.shape[0], offs_k.shape[0])


@triton.jit
def dequant_tile(w_ptr, row_off, offs_k, GGML_TYPE: tl.constexpr):
    """fp32 [BN, BK] tile of a GGUF weight of ggml type GGML_TYPE (a ``gguf.GGMLQuantizationType`` value: Q8_0,
    Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K): element [i, j] is weight[row i, offs_k[j]], bit-exact with
    ``gguf_blocks.dequantize``. w_ptr: uint8 pointer; row_off [BN] int64 byte offsets of the rows' first
    blocks; offs_k [BK] int32, BK a multiple of 32 (runs of 32 as the module doc says). Another type fails to
    compile (static_assert)."""
    if GGML_TYPE == Q8_0:
        return dequant_q8_0(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q4_0:
        return dequant_q4_0(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q4_1:
        return dequant_q4_1(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q5_0:
        return dequant_q5_0(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q5_1:
        return dequant_q5_1(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q2_K:
        return dequant_q2_k(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q3_K:
        return dequant_q3_k(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q4_K:
        return dequant_q4_k(w_ptr, row_off, offs_k)
    elif GGML_TYPE == Q5_K:
        return dequant_q5_k(w_ptr, row_off, offs_k)
    else:
        tl.static_assert(GGML_TYPE == Q6_K, "dequant_tile: unsupported ggml type")
        return dequant_q6_k(w_ptr, row_off, offs_k)
