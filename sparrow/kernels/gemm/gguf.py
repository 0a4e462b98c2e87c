"""Dense linears on raw GGUF (ggml) blocks: y = x @ W^T with W's blocks kept packed, dequantized in registers
by the Triton kernel (``_gguf_jit.gguf_matmul_kernel``) or in bounded row chunks by the torch twin.

    gguf_linear(x [R, K], qweight uint8 [N, K // B * T], ggml_type, bias [N] | None) -> y [R, N], x's dtype

Weight layout (shared with the GGUF experts and the GGUF format module): a weight of logical shape [N, K] of
ggml type t (B elements, T bytes per block, ``gguf_blocks.block_bytes``) is uint8 [N, K // B * T], each row its
blocks exactly as in the file (the file's own byte order); stacked experts are [E, N, K // B * T]. Types:
``GGUF_TYPES`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; formats: ggml-common.h, gguf-py's
quants.py). x is fp32 / bf16 / fp16; the weight is dequantized bit-exactly (``gguf_blocks``), rounded to x's
dtype, multiplied by x with fp32 sums, the fp32 bias added, and y rounded once to x's dtype.

Paths (``gguf_linear``): Triton where ``use_triton(x)`` (CUDA tensors, or ``backend("triton")`` under the
interpreter): FMA GEMV for R <= 4, tensor-core GEMV for R <= GEMV_MAX_ROWS (decode and speculative verify),
a GEMM past it; else the twin ``gguf_linear_ref`` (the CPU path). Tile configs: ``GGUF_CONFIGS`` (defaults,
not tuned on a GPU) with ``GEMV1_BY_TYPE`` ahead of it for one row (Q6_K, Q8_0: timed on an H100), overridden
per card by ``config_file`` if present, or by ``with forced_config(cfg):``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import torch
from gguf.constants import GGMLQuantizationType as T

from sparrow.errors import ModelLoadError, UnsupportedGGUFTypeError
from sparrow.kernels import ForcedConfig, dispatch, interpreting, pdl_kwargs
from sparrow.kernels.common import gguf_blocks, split_k
from sparrow.kernels.common.tiles import CONFIG_DIR, cdiv

GGUF_TYPES: frozenset[T] = frozenset((T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                                      T.Q6_K))
"""The ggml block types the GGUF kernels take (the float types F32 / F16 / BF16 are plain linears)."""
GEMV_MAX_ROWS = 16
"""Rows up to which the kernel runs as a GEMV (one M tile: each weight byte read once per call)."""
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

TWIN_CHUNK_ELEMS = {"cpu": 1 << 20, "cuda": 1 << 25}
"""Weight elements the twin dequantizes per step (whole rows, at least one), by device type, into buffers kept
between calls (``_twin_buffers``: 4 + 1 MB on CPU). CPU, 2-core machine, R = 1, one torch thread: Gemma 3 270M's
tied LM head (Q8_0 262144 x 640, streamed from DRAM) takes 78 ms at 2^20, 86 at 2^19, 92 at 2^21 (4 MB of fp32 rows
stay in cache between the three passes over them: convert, scale, mm); its decoder layer's linears 8.0 ms at 2^20,
7.5 at 2^21, 8.9 at 2^19 (thread CPU time, best of 3, machine loaded ~8); 2^16 and below are 2-4x slower (a dozen
torch ops per chunk, each with its fixed cost); a GPU wants few, large launches."""


@dataclasses.dataclass(frozen=True)
class GgufConfig:
    """A tile config of ``gguf_matmul_kernel``."""
    block_m: int
    """Rows of x per program: 1, 2 or 4 with ``fma``, else a power of two >= 16."""
    block_n: int
    """Weight rows (outputs) per program: a power of two (>= 16 without ``fma``)."""
    block_k: int
    """K elements per step: a power of two >= 32 (whole 32-element groups)."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    """Programs per N tile over contiguous K ranges (with one M tile); 0: enough for split_k.FILL_PROGRAMS."""
    fma: bool = False
    """fp32 FMAs on the decoded tile instead of a tensor-core dot (GEMV of a few rows)."""


# (largest R, config), smallest bound first. Defaults, not timed on a GPU: tiles whose sm_90 build (ptxas,
# Triton 3.9, bf16 x) has no register spills for any type (Q6_K, the largest decoder, needs up to 254 registers
# at these sizes; 64 x 256 FMA tiles and 64 x 128 dot tiles spill), automatic split-K to fill the SMs.
GGUF_CONFIGS: tuple[tuple[int, GgufConfig], ...] = (
    (1, GgufConfig(block_m=1, block_n=64, block_k=128, num_warps=8, split_k=0, fma=True)),
    (2, GgufConfig(block_m=2, block_n=16, block_k=256, num_warps=4, split_k=0, fma=True)),
    (4, GgufConfig(block_m=4, block_n=16, block_k=256, num_warps=4, split_k=0, fma=True)),
    (GEMV_MAX_ROWS, GgufConfig(block_m=16, block_n=32, block_k=64, num_warps=4, split_k=0)),
    (1 << 62, GgufConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)),
)
# Batch-1 decode tiles by type, ahead of GGUF_CONFIGS' R = 1 entry. Eager timings, H100 80GB HBM3, Triton 3.6,
# bf16 x (benchmarks/gguf_gemv_sweep.py's tiles): Q6_K 14336 x 4096 264 -> 158 us (8 x 256, 2 warps: fewer
# registers a program, more programs resident; every 4..16-row tile measured 158-179 us), Q8_0 4096 x 4096
# 74 -> 56 us (16 x 256, no split-K: no partials / counter round trip). Q4_K and Q5_0 kept: their eager times at
# these shapes vary by 1.5x between runs of one tile (host-bound), so no tile was shown better.
GEMV1_BY_TYPE: dict[T, GgufConfig] = {
    T.Q6_K: GgufConfig(block_m=1, block_n=8, block_k=256, num_warps=2, split_k=0, fma=True),
    T.Q8_0: GgufConfig(block_m=1, block_n=16, block_k=256, num_warps=4, split_k=1, fma=True),
}
forced_config = ForcedConfig()  # ``with forced_config(GgufConfig(...)):`` overrides the tables


def config_file(device_name: str) -> pathlib.Path:
    """The tuned tile file of a device (its ``torch.cuda.get_device_name()``, spaces as underscores):
    {"configs": {"R": GgufConfig fields}}, each entry covering the rows up to R (smallest first). None ships."""
    return CONFIG_DIR / f"gguf_linear_{device_name.replace(' ', '_')}.json"


@functools.lru_cache(maxsize=8)
def tuned_configs(device_name: str) -> tuple[tuple[int, GgufConfig], ...]:
    """(largest R, config) entries of ``config_file``, smallest bound first; () when there is none."""
    path = config_file(device_name)
    if not path.is_file():
        return ()
    data = json.loads(path.read_text())["configs"]
    return tuple(sorted((int(r), GgufConfig(**c)) for r, c in data.items()))


def pick_config(rows: int, device_name: str | None = None, ggml_type: int | None = None) -> GgufConfig:
    """The forced config, else the first entry covering ``rows`` of the card's file, else for one row the
    type's GEMV1_BY_TYPE tile, else the first entry of GGUF_CONFIGS covering ``rows``."""
    if forced_config.value is not None:
        return forced_config.value
    tuned = next((c for bound, c in (tuned_configs(device_name) if device_name else ()) if rows <= bound), None)
    if tuned is not None:
        return tuned
    if rows == 1 and ggml_type is not None and int(ggml_type) in GEMV1_BY_TYPE:
        return GEMV1_BY_TYPE[T(int(ggml_type))]
    return next(c for bound, c in GGUF_CONFIGS if rows <= bound)


def gguf_weight_bytes(qweight: torch.Tensor) -> int:
    """Bytes a GGUF linear reads of its weight per call (every block once: the GEMV's roofline numerator)."""
    return qweight.numel() * qweight.element_size()


def _type_name(ggml_type: int) -> str:
    try:
        return T(int(ggml_type)).name
    except ValueError:
        return f"unknown ggml type {int(ggml_type)}"


def check_gguf_linear(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
                      name: str = "gguf_linear") -> tuple[int, int]:
    """(B, T) of ``ggml_type`` after checking the operands of ``gguf_linear``. Raises UnsupportedGGUFTypeError
    for a type outside GGUF_TYPES, ModelLoadError naming the problem for x not fp32 / bf16 / fp16 [R, K] with
    unit stride on K, K not a multiple of B, qweight not uint8 [N, K // B * T] with unit last stride, a bias
    other than a float [N], or operands on different devices."""
    if ggml_type not in GGUF_TYPES:
        raise UnsupportedGGUFTypeError(
            f"{name}: ggml type {_type_name(ggml_type)} has no GGUF kernel (supported: "
            f"{', '.join(sorted(t.name for t in GGUF_TYPES))})")
    block, type_bytes = gguf_blocks.block_bytes(ggml_type)
    tname = _type_name(ggml_type)
    if x.dim() != 2 or x.dtype not in _X_DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ModelLoadError(f"{name}: x must be fp32 / bf16 / fp16 [R, K] with unit stride on K, got "
                             f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    k = x.shape[1]
    if k % block:
        raise ModelLoadError(f"{name}: K = {k} is not a multiple of the {tname} block of {block} elements")
    want = k // block * type_bytes
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != want:
        raise ModelLoadError(
            f"{name}: qweight must be uint8 [N, {want}] ({tname}: K = {k} in {k // block} blocks of {type_bytes} "
            f"bytes), got {tuple(qweight.shape)} {qweight.dtype}")
    if qweight.shape[1] > 1 and qweight.stride(1) != 1:
        raise ModelLoadError(f"{name}: qweight needs unit stride on its bytes, got strides {qweight.stride()}")
    if bias is not None and (bias.shape != (qweight.shape[0],) or not bias.is_floating_point()):
        raise ModelLoadError(f"{name}: bias must be a float [{qweight.shape[0]}], got {tuple(bias.shape)} "
                             f"{bias.dtype}")
    if qweight.device != x.device or (bias is not None and bias.device != x.device):
        raise ModelLoadError(f"{name}: x, qweight and bias must be on one device, got {x.device}, "
                             f"{qweight.device}{'' if bias is None else f', {bias.device}'}")
    return block, type_bytes


def _f16_field(b: torch.Tensor, start: int) -> torch.Tensor:
    """(nb, T) uint8 blocks (T and ``start`` even) -> (nb, 1) fp32: the fp16 field at byte ``start``, read in one
    strided op through an int16 view of the blocks (no contiguous copy of the two bytes first)."""
    if b.storage_offset() % 2:  # an int16 view needs an even byte offset
        b = b.clone()
    return b.view(torch.int16)[:, start // 2:start // 2 + 1].view(torch.float16).float()


def _signed_words(words: torch.Tensor, sign_bits: torch.Tensor, width: int) -> None:
    """words int32 (4 codes q of ``width`` bits a word, one per byte, without their top bit) <- q - 2^(width - 1)
    as int8 bytes, in place: ``sign_bits`` int32 holds q's top bit at bit 0 of each byte; q - 2^(width - 1) is the
    code's low bits where that bit is set, else the low bits with every higher bit set (two's complement). A
    byte is 0 or 1 times the fill, so no carry crosses bytes. Saves the float pass that subtracts the offset."""
    fill = 0x100 - (1 << (width - 1))  # Q5_0: 0xF0
    sign_bits ^= 0x01010101
    sign_bits *= fill
    words |= sign_bits


def _nibbles_into(u: torch.Tensor, qs: torch.Tensor) -> None:
    """u [..., 2, G] uint8 (contiguous, G % 4 == 0) <- the low nibbles of qs [..., G], then its high nibbles:
    qs copied contiguous once, then both read as int32 words (4 bytes an operation: uint8 ops on strided views
    are 3-4x slower on CPU)."""
    words = qs.contiguous().view(torch.int32)
    out = u.view(torch.int32)
    torch.bitwise_and(words, 0x0F0F0F0F, out=out[..., 0, :])
    torch.bitwise_right_shift(words, 4, out=out[..., 1, :]).bitwise_and_(0x0F0F0F0F)


def _fast_q8_0(b, out, u):
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16_field(b, 0))


def _fast_q4_0(b, out, u):
    _nibbles_into(u.view(-1, 2, 16), b[:, 2:])
    out.copy_(u).sub_(8).mul_(_f16_field(b, 0))


def _fast_q5_0(b, out, u):
    nb = b.shape[0]
    _nibbles_into(u.view(nb, 2, 16), b[:, 6:])
    qh = b[:, 2:6].contiguous().view(torch.int32)  # little-endian: bit j is element j's 5th bit
    # word w of u holds elements 4w .. 4w + 3 (one a byte): qh's bits 4w .. 4w + 3 spread to bit 0 of each byte
    # (x * 0x00204081 = x | x << 7 | x << 14 | x << 21 for x < 16: bit i lands on bit 8 i, no carries)
    hi = torch.bitwise_right_shift(qh, _NIBBLE_SHIFTS).bitwise_and_(0xF).mul_(0x00204081).bitwise_and_(0x01010101)
    _signed_words(u.view(torch.int32).view(nb, 8), hi, 5)
    out.copy_(u.view(torch.int8)).mul_(_f16_field(b, 0))


def _fast_q4_k(b, out, u):
    nb = b.shape[0]
    sc, mn = gguf_blocks._scale_min_k4(b[:, 4:16])
    _nibbles_into(u.view(nb, 4, 2, 32), b[:, 16:].view(nb, 4, 32))
    out.copy_(u)
    out.view(nb, 8, 32).mul_((_f16_field(b, 0) * sc).unsqueeze(-1)).sub_((_f16_field(b, 2) * mn).unsqueeze(-1))


def _fast_q6_k(b, out, u):
    nb = b.shape[0]
    _nibbles_into(u.view(nb, 2, 2, 64), b[:, :128].view(nb, 2, 64))
    qh = b[:, 128:192].contiguous().view(torch.int32).view(nb, 2, 8)  # 4 bytes a word, as _nibbles_into
    planes = u.view(torch.int32).view(nb, 2, 4, 8)
    for p in range(4):  # bit pair p of qh is the top 2 bits of the p-th 32 elements of each half
        planes[:, :, p] |= ((qh >> (2 * p)) & 0x03030303) << 4
    dl = _f16_field(b, 208) * b[:, 192:208].view(torch.int8).float()
    out.copy_(u).sub_(32).view(nb, 16, 16).mul_(dl.unsqueeze(-1))


_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_FAST_DECODERS = {T.Q8_0: _fast_q8_0, T.Q4_0: _fast_q4_0, T.Q5_0: _fast_q5_0, T.Q4_K: _fast_q4_k,
                  T.Q6_K: _fast_q6_k}
"""The twin's CPU dequantizers of the packaged models' hot types (Gemma 3 270M Q4_K_M: Q8_0, Q5_0, Q4_K, Q6_K;
plus Q4_0): the formulas and float-op order of ``gguf_blocks`` (bit-exact: tests/kernels/gemm/test_gguf_linear.py),
written into reused buffers with scalar shifts and in-place ops on int32 words, 2-4x faster on CPU (Q5_0 builds
its signed codes q - 16 in the bytes, ``_signed_words``: its fifth bits spread by one multiply on a quarter of the
elements, no float subtraction; 1024 x 640: 1.7-6.6 -> 1.0 ms, 2048 x 640: 3.9-10 -> 1.9 ms, one thread, loaded
2-core machine); other types use ``gguf_blocks`` as is. Each takes blocks (nb, T) uint8, out fp32 (nb, B), scratch
u uint8 (nb, B)."""


def dequantize_rows(qweight: torch.Tensor, ggml_type: int, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Rows qweight [c, K // B * T] (contiguous) dequantized into out fp32 [c, K] (bit-exact with
    ``gguf_blocks.dequantize``), using scratch uint8 [>= c * K] on the hot types; returns out."""
    qtype = T(int(ggml_type))
    _, type_bytes = gguf_blocks.block_bytes(qtype)
    blocks = qweight.reshape(-1, type_bytes)
    flat = out.view(blocks.shape[0], -1)
    fast = _FAST_DECODERS.get(qtype) if qweight.device.type == "cpu" else None
    if fast is not None:
        fast(blocks, flat, scratch[:out.numel()].view(flat.shape))
    else:
        flat.copy_(gguf_blocks._BLOCK_FNS[qtype](blocks))
    return out


_TWIN_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _twin_buffers(device: torch.device, elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's (fp32, uint8) chunk buffers of at least ``elems`` elements on ``device``, kept between calls:
    a fresh multi-MB buffer per call costs its page faults on every token. Calls run one at a time per process
    (the engine's step loop); a kernel call never keeps a reference past its return. They are made outside
    inference mode: one made by an engine step (inference mode) could not be written by a later plain call. CUDA: fresh buffers (the
    caching allocator reuses them; the twin is only the GPU's test oracle, so nothing is held for it)."""
    if device.type != "cpu":
        return (torch.empty(elems, dtype=torch.float32, device=device),
                torch.empty(elems, dtype=torch.uint8, device=device))
    bufs = _TWIN_BUFFERS.get(device)
    if bufs is None or bufs[0].numel() < elems:
        with torch.inference_mode(False):  # normal tensors: written in place both inside and outside inference mode
            bufs = _TWIN_BUFFERS[device] = (torch.empty(elems, dtype=torch.float32, device=device),
                                            torch.empty(elems, dtype=torch.uint8, device=device))
    return bufs


def gguf_linear_ref(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin (and CPU path): x [R, K] @ W^T (+ bias) -> [R, N] in x's dtype, W dequantized from
    qweight's blocks (bit-exact with gguf-py: ``dequantize_rows``) ``TWIN_CHUNK_ELEMS`` elements of rows at a
    time into one reused buffer, rounded to x's dtype, multiplied by x in fp32 (sums in fp32), bias added in
    fp32, rounded once. Errors: ``check_gguf_linear``."""
    check_gguf_linear(x, qweight, ggml_type, bias, "gguf_linear_ref")
    (rows, k), n = x.shape, qweight.shape[0]
    yt = torch.empty(n, rows, dtype=torch.float32, device=x.device)  # y^T: each chunk's rows are contiguous
    if n and k and rows:
        xt = x.float().t()
        step = min(n, max(1, TWIN_CHUNK_ELEMS.get(x.device.type, 1 << 16) // k))
        wbuf, scratch = _twin_buffers(x.device, step * k)
        wbuf = wbuf[:step * k].view(step, k)
        for n0 in range(0, n, step):
            chunk = qweight[n0:n0 + step].contiguous()
            w = dequantize_rows(chunk, ggml_type, wbuf[:chunk.shape[0]], scratch)
            if x.dtype != torch.float32:
                w = w.to(x.dtype).float()
            torch.mm(w, xt, out=yt[n0:n0 + chunk.shape[0]])
    else:
        yt.zero_()
    if bias is not None:
        yt += bias.float()[:, None]
    return yt.t().contiguous().to(x.dtype)  # contiguous [R, N], as F.linear returns (in-place users: masks)


def gguf_linear_triton(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher of ``gguf_linear_ref`` (same contract and errors): ``gguf_matmul_kernel`` with the
    config for R (FMA GEMV, dot GEMV or GEMM). Raises ValueError for a forced config the kernel cannot run."""
    from sparrow.kernels.gemm._gguf_jit import gguf_matmul_kernel

    check_gguf_linear(x, qweight, ggml_type, bias, "gguf_linear")
    (rows, k), n = x.shape, qweight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(x.dtype).expand(rows, n))
    cfg = pick_config(rows, torch.cuda.get_device_name(x.device) if x.is_cuda else None, ggml_type)
    _check_config(cfg)
    interp = interpreting()
    m_tiles, n_tiles = cdiv(rows, cfg.block_m), cdiv(n, cfg.block_n)
    split, ws, locks = split_k.plan(x.device, n_tiles, cdiv(k, cfg.block_k), cfg.split_k if m_tiles == 1 else 1,
                                    cfg.block_m * cfg.block_n, y)
    gguf_matmul_kernel[(n_tiles, m_tiles, split)](
        x, qweight, bias if bias is not None else y, y, ws, locks, rows, n, k, x.stride(0), qweight.stride(0),
        GGML_TYPE=int(ggml_type), HAS_BIAS=bias is not None, FMA=cfg.fma,
        UPCAST=interp or x.dtype == torch.float32, RNE=interp and x.dtype == torch.bfloat16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kwargs(x))
    return y


def _check_config(cfg: GgufConfig) -> None:
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    ok = pow2(cfg.block_n) and pow2(cfg.block_k) and cfg.block_k >= 32 and (
        cfg.block_m in (1, 2, 4) if cfg.fma else pow2(cfg.block_m) and cfg.block_m >= 16 and cfg.block_n >= 16)
    if not ok:
        raise ValueError(f"gguf_linear: {cfg} does not fit the kernel (block_k a power of two >= 32; FMA: block_m "
                         "1, 2 or 4; dots: block_m and block_n powers of two >= 16)")


gguf_linear = dispatch("gguf_linear", gguf_linear_triton, gguf_linear_ref, """y = x [R, K] @ W^T (+ bias) -> [R, N]
    in x's dtype for a GGUF weight qweight uint8 [N, K // B * T] of ggml type ``ggml_type`` (the module doc;
    ``gguf_linear_ref``'s signature): ``gguf_linear_triton`` where ``use_triton(x)``, else the twin.""")
