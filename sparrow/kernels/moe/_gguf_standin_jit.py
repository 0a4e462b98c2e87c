"""TEMPORARY stand-in for ``sparrow.kernels.common._gguf_dequant_jit.dequant_tile`` (branch gguf-kernels), so the
GGUF experts (``_gguf_moe_jit``) run before the shared function lands; delete this module and import the shared one
then. Element-wise byte gathers (correct, not fast): formats as ``sparrow.kernels.common.gguf_blocks`` (ggml-common.h
block structs, ggml-quants.c ``dequantize_row_*``), the same float operation order.

    dequant_tile(w_ptr uint8*, row_off [BN] int64 byte offsets of the rows, offs_k [BK] int32 element indices,
                 GGML_TYPE constexpr) -> fp32 [BN, BK]
"""
import triton
import triton.language as tl


@triton.jit
def _byte(w_ptr, off):
    return tl.load(w_ptr + off).to(tl.int32)


@triton.jit
def _f16(w_ptr, off):
    lo = tl.load(w_ptr + off).to(tl.uint16)
    hi = tl.load(w_ptr + off + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(w_ptr, sc_off, sb):
    """ggml get_scale_min_k4 of sub-block sb (8 of 32 elements) from the 12 scale bytes at sc_off."""
    lo = sb < 4
    sb4 = tl.where(lo, sb, sb - 4)
    a = _byte(w_ptr, sc_off + sb4)
    m = _byte(w_ptr, sc_off + 4 + sb4)
    c = _byte(w_ptr, sc_off + 8 + sb4)
    sc = tl.where(lo, a & 63, (c & 0xF) | ((a >> 2) & 0x30))
    mn = tl.where(lo, m & 63, (c >> 4) | ((m >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def dequant_tile(w_ptr, row_off, offs_k, GGML_TYPE: tl.constexpr):
    if GGML_TYPE == 8:  # Q8_0: d | int8 qs[32]
        B: tl.constexpr = 32
        T: tl.constexpr = 34
    elif GGML_TYPE == 2:  # Q4_0
        B: tl.constexpr = 32
        T: tl.constexpr = 18
    elif GGML_TYPE == 3:  # Q4_1
        B: tl.constexpr = 32
        T: tl.constexpr = 20
    elif GGML_TYPE == 6:  # Q5_0
        B: tl.constexpr = 32
        T: tl.constexpr = 22
    elif GGML_TYPE == 7:  # Q5_1
        B: tl.constexpr = 32
        T: tl.constexpr = 24
    elif GGML_TYPE == 10:  # Q2_K
        B: tl.constexpr = 256
        T: tl.constexpr = 84
    elif GGML_TYPE == 11:  # Q3_K
        B: tl.constexpr = 256
        T: tl.constexpr = 110
    elif GGML_TYPE == 12:  # Q4_K
        B: tl.constexpr = 256
        T: tl.constexpr = 144
    elif GGML_TYPE == 13:  # Q5_K
        B: tl.constexpr = 256
        T: tl.constexpr = 176
    else:  # 14: Q6_K
        B: tl.constexpr = 256
        T: tl.constexpr = 210
    j = (offs_k % B)[None, :]
    base = row_off[:, None] + ((offs_k // B) * T).to(tl.int64)[None, :]  # [BN, BK] block starts
    if GGML_TYPE == 8:
        q = tl.load(w_ptr + base + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
        y = q * _f16(w_ptr, base)
    elif GGML_TYPE == 2 or GGML_TYPE == 3 or GGML_TYPE == 6 or GGML_TYPE == 7:
        QS: tl.constexpr = 2 if GGML_TYPE == 2 else 4 if GGML_TYPE == 3 else 6 if GGML_TYPE == 6 else 8
        q = (_byte(w_ptr, base + QS + (j % 16)) >> ((j // 16) * 4)) & 0xF
        if GGML_TYPE == 6 or GGML_TYPE == 7:
            QH: tl.constexpr = 2 if GGML_TYPE == 6 else 4
            q = q | (((_byte(w_ptr, base + QH + j // 8) >> (j % 8)) & 1) << 4)
        d = _f16(w_ptr, base)
        if GGML_TYPE == 2:
            y = d * (q.to(tl.float32) - 8)
        elif GGML_TYPE == 6:
            y = d * (q.to(tl.float32) - 16)
        else:
            y = d * q.to(tl.float32) + _f16(w_ptr, base + 2)
    elif GGML_TYPE == 10:
        sc = _byte(w_ptr, base + j // 16)
        dl = _f16(w_ptr, base + 80) * (sc & 0xF).to(tl.float32)
        ml = _f16(w_ptr, base + 82) * (sc >> 4).to(tl.float32)
        q = (_byte(w_ptr, base + 16 + (j // 128) * 32 + j % 32) >> (((j % 128) // 32) * 2)) & 3
        y = dl * q.to(tl.float32) - ml
    elif GGML_TYPE == 11:
        sb = j // 16
        low = (_byte(w_ptr, base + 96 + sb % 8) >> ((sb // 8) * 4)) & 0xF
        high = (_byte(w_ptr, base + 104 + sb % 4) >> ((sb // 4) * 2)) & 3
        dl = _f16(w_ptr, base + 108) * ((low | (high << 4)) - 32).to(tl.float32)
        ql = (_byte(w_ptr, base + 32 + (j // 128) * 32 + j % 32) >> (((j % 128) // 32) * 2)) & 3
        hb = (_byte(w_ptr, base + j % 32) >> (j // 32)) & 1
        y = dl * (ql - ((hb ^ 1) << 2)).to(tl.float32)
    elif GGML_TYPE == 12 or GGML_TYPE == 13:
        sc, mn = _k4_scale_min(w_ptr, base + 4, j // 32)
        dl = _f16(w_ptr, base) * sc
        ml = _f16(w_ptr, base + 2) * mn
        QS: tl.constexpr = 16 if GGML_TYPE == 12 else 48
        q = (_byte(w_ptr, base + QS + (j // 64) * 32 + j % 32) >> (((j % 64) // 32) * 4)) & 0xF
        if GGML_TYPE == 13:
            q = q | (((_byte(w_ptr, base + 16 + j % 32) >> (j // 32)) & 1) << 4)
        y = dl * q.to(tl.float32) - ml
    else:
        low = (_byte(w_ptr, base + (j // 128) * 64 + j % 64) >> (((j % 128) // 64) * 4)) & 0xF
        high = (_byte(w_ptr, base + 128 + (j // 128) * 32 + j % 32) >> (((j % 128) // 32) * 2)) & 3
        s = tl.load(w_ptr + base + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        dl = _f16(w_ptr, base + 208) * s
        y = dl * ((low | (high << 4)).to(tl.float32) - 32)
    return y
