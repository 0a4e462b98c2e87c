"""sparrow.kernels.common.gguf_blocks.dequantize against gguf-py's numpy dequantizers: bit-exact (torch.equal), every type.

Inputs come from gguf-py's own quantizer where it has one, and from random bytes per block otherwise (and
additionally for every block type, to reach bit patterns a quantizer never writes); in random blocks the
fp16 scale fields are overwritten with finite, moderate values so no inf / NaN can appear.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from sparrow.errors import ModelLoadError, UnsupportedGGUFTypeError
from sparrow.kernels.common.gguf_blocks import SUPPORTED_TYPES, block_bytes, dequantize


# byte offsets of the fp16 fields (d, dmin, m) inside one block (ggml-common.h)
FP16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf-py can quantize these
ALL_TYPES = tuple(sorted(SUPPORTED_TYPES))
SHAPES = [(256,), (1, 256), (2, 512), (3, 512), (17, 768), (2, 3, 256)]


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator, fp16_max: float = 2.0) -> np.ndarray:
    """Random bytes for a tensor of `shape`, fp16 fields (scales d, mins dmin / m) set to finite values in
    [-fp16_max, fp16_max]."""
    block_elems, type_bytes = block_bytes(qtype)
    n_blocks = int(np.prod(shape)) // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, type_bytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(-fp16_max, fp16_max, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def check(raw: np.ndarray, qtype: T, shape: tuple[int, ...], name: str = "t") -> None:
    want = gq.dequantize(raw.view(np.uint8), qtype).astype(np.float32).reshape(shape)
    assert not np.isnan(want).any()
    got = dequantize(torch.from_numpy(raw.view(np.uint8).copy()), qtype, shape, name)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, torch.from_numpy(want)), f"{qtype.name} {shape} differs from gguf-py"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf_py(qtype: T, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(list(shape) + [int(qtype)])
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
    check(gq.quantize(x, qtype), qtype, shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks(qtype: T, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(list(shape) + [int(qtype), 1])
    check(random_blocks(qtype, shape, rng), qtype, shape)


def test_float_special_values() -> None:
    """F32 / F16 / BF16 keep signed zeros, subnormals and infinities exactly."""
    vals = np.array([0.0, -0.0, 1e-40, -3.5, 65504.0, np.inf, -np.inf, 2.0**-24], dtype=np.float32)
    for qtype in (T.F32, T.F16, T.BF16):
        raw = gq.quantize(vals, qtype).view(np.uint8)
        want = torch.from_numpy(gq.dequantize(raw, qtype).astype(np.float32))
        got = dequantize(torch.from_numpy(raw.copy()), qtype, (8,))
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), qtype.name


def test_raw_of_any_shape_and_dtype() -> None:
    """raw is flattened; a non-uint8 tensor is read as its bytes; a misaligned slice still works."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q = gq.quantize(x, T.Q8_0)
    want = torch.from_numpy(gq.dequantize(q, T.Q8_0))
    assert torch.equal(dequantize(torch.from_numpy(q.copy()).reshape(-1, 2), T.Q8_0, (4, 64)), want)
    assert torch.equal(dequantize(torch.from_numpy(x), T.F32, (4, 64)), torch.from_numpy(x))
    buf = torch.zeros(1 + x.nbytes, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(x.view(np.uint8).reshape(-1))
    assert torch.equal(dequantize(buf[1:], T.F32, (4, 64)), torch.from_numpy(x))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.TQ1_0, T.Q8_K], ids=lambda t: t.name)
def test_unsupported_type_names_type_and_tensor(qtype: T) -> None:
    _, type_bytes = block_bytes(qtype)
    raw = torch.zeros(type_bytes, dtype=torch.uint8)
    with pytest.raises(UnsupportedGGUFTypeError) as err:
        dequantize(raw, qtype, (256,), "blk.3.ffn_down.weight")
    assert qtype.name in str(err.value) and "blk.3.ffn_down.weight" in str(err.value)
    with pytest.raises(UnsupportedGGUFTypeError, match="999"):
        dequantize(raw, 999, (256,), "x")


@pytest.mark.parametrize("qtype", [T.F32, T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_wrong_byte_count(qtype: T) -> None:
    block_elems, type_bytes = block_bytes(qtype)
    shape = (2, 256)
    n_bytes = 512 // block_elems * type_bytes
    for bad in (n_bytes - 1, n_bytes + type_bytes):
        with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight"):
            dequantize(torch.zeros(bad, dtype=torch.uint8), qtype, shape, "blk.0.attn_q.weight")


def test_row_not_multiple_of_block() -> None:
    with pytest.raises(ModelLoadError, match="multiple of 256"):
        dequantize(torch.zeros(2 * 210, dtype=torch.uint8), T.Q6_K, (4, 128), "w")


def test_block_bytes() -> None:
    assert block_bytes(T.Q4_K) == (256, 144)
    assert block_bytes(T.Q8_0) == (32, 34)
    assert block_bytes(T.F32) == (1, 4)
    with pytest.raises(UnsupportedGGUFTypeError):
        block_bytes(999)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # read-only mmap, only read here
def test_gemma3_270m_tensors() -> None:
    """The smallest tensor of each type in the packaged model (F32, Q5_0, Q4_K, Q8_0, Q6_K) matches gguf-py;
    every tensor of the model passes the size checks, and dequantizing all of them takes about a second
    (the bound below is loose: other jobs share the CPUs; a per-block Python loop would take minutes).
    Most of this test's time is GGUFReader parsing the 262k-entry vocabulary (~10 s)."""
    import gguf

    from sparrow.default_model import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))  # where sparrow puts it (assembled on first use)
    smallest: dict[int, gguf.ReaderTensor] = {}
    for t in reader.tensors:
        if t.tensor_type not in smallest or t.n_bytes < smallest[t.tensor_type].n_bytes:
            smallest[t.tensor_type] = t
    assert {T.F32, T.Q5_0, T.Q4_K, T.Q8_0, T.Q6_K} <= set(smallest)
    for t in smallest.values():
        shape = tuple(int(n) for n in reversed(t.shape))
        want = gq.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        got = dequantize(torch.from_numpy(t.data.view(np.uint8).copy()), t.tensor_type, shape, t.name)
        assert torch.equal(got, torch.from_numpy(want)), t.name

    start = time.perf_counter()
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        dequantize(torch.frombuffer(t.data.view(np.uint8), dtype=torch.uint8), t.tensor_type, shape, t.name)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"dequantizing Gemma 3 270M took {elapsed:.1f} s; expected a few seconds at most"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: T) -> None:
    """The same torch code on a CUDA tensor gives the CPU result bit for bit (no fused multiply-add)."""
    shape = (33, 1024)
    rng = np.random.default_rng(int(qtype))
    if qtype in FP16_FIELDS:
        raw = torch.from_numpy(random_blocks(qtype, shape, rng))
    else:
        raw = torch.from_numpy(gq.quantize(rng.standard_normal(shape).astype(np.float32), qtype).view(np.uint8))
    want = dequantize(raw, qtype, shape)
    got = dequantize(raw.cuda(), qtype, shape)
    assert got.is_cuda
    assert torch.equal(got.cpu(), want)
