"""The Triton GGUF tile dequantizers (sparrow/kernels/common/_gguf_dequant_jit.py) against their torch twin
``gguf_blocks.dequantize`` (itself bit-exact with gguf-py: test_gguf_blocks.py): torch.equal, every type, on
random blocks (finite fp16 fields) and on gguf-py-quantized ones where gguf-py has a quantizer. CPU: the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) at small shapes; on a GPU the
same tests run the compiled kernel, and a GPU-marked test covers a larger tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from sparrow.kernels.common._gguf_dequant_jit import dequant_tile
from sparrow.kernels.common.gguf_blocks import block_bytes, dequantize
from tests.kernels.common.test_gguf_blocks import random_blocks

BLOCK_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, K, stride_w, GGML_TYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out [N, K] fp32 = the dequantized weight, one [BN, BK] tile per program (rows clamped, K wrapped)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    row_off = tl.minimum(rows, N - 1).to(tl.int64) * stride_w
    tile = dequant_tile(w_ptr, row_off, offs_k % K, GGML_TYPE)
    mask = (rows[:, None] < N) & (offs_k[None, :] < K)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :], tile, mask=mask)


def triton_dequantize(qweight: torch.Tensor, qtype: T, k: int, bn: int = 4, bk: int = 64) -> torch.Tensor:
    n = qweight.shape[0]
    out = torch.empty(n, k, dtype=torch.float32, device=qweight.device)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](qweight, out, n, k, qweight.stride(0), GGML_TYPE=int(qtype),
                                                              BN=bn, BK=bk)
    return out


def _qweight(qtype: T, n: int, k: int, seed: int, device: str = DEVICE) -> torch.Tensor:
    blocks = random_blocks(qtype, (n, k), np.random.default_rng(seed))
    return torch.from_numpy(blocks).reshape(n, -1).to(device)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequant_tile_random_blocks(qtype):
    n, k = 5, 512  # N not a multiple of BN; BK = 64 covers two sub-blocks of a K-quant per tile
    qweight = _qweight(qtype, n, k, seed=int(qtype))
    got = triton_dequantize(qweight, qtype, k)
    assert torch.equal(got, dequantize(qweight, qtype, (n, k)))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequant_tile_tail_and_wide_tile(qtype):
    """BK = 256 over K = 768 of 32-blocks (K-quants: 3 super-blocks) and BK = 32 on a tail tile (wrapped)."""
    block, _ = block_bytes(qtype)
    k = 768 if block == 256 else 96
    qweight = _qweight(qtype, 3, k, seed=7 + int(qtype))
    want = dequantize(qweight, qtype, (3, k))
    assert torch.equal(triton_dequantize(qweight, qtype, k, bn=2, bk=256), want)
    assert torch.equal(triton_dequantize(qweight, qtype, k, bn=4, bk=32), want)


@pytest.mark.parametrize("qtype", (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1), ids=lambda t: t.name)
def test_dequant_tile_quantized_weights(qtype):
    """Blocks written by gguf-py's own quantizer (the bit patterns a real file holds)."""
    w = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32)
    raw = torch.from_numpy(gq.quantize(w, qtype)).reshape(4, -1).to(DEVICE)
    assert torch.equal(triton_dequantize(raw, qtype, 128), dequantize(raw, qtype, (4, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequant_tile_gpu_large(qtype):
    n, k = 512, 4096
    qweight = _qweight(qtype, n, k, seed=11, device="cuda")
    got = triton_dequantize(qweight, qtype, k, bn=16, bk=256)
    assert torch.equal(got, dequantize(qweight, qtype, (n, k)))
