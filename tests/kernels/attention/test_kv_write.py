"""Triton paged KV write vs its torch twin (interpreter on CPU): exact copy, skipped negative slots."""
import pytest
import torch

from sparrow.kernels.attention.paged_attention import write_kv_ref, write_kv_triton


@pytest.mark.parametrize("rows,hkv,d,dtype", [(1, 1, 64, torch.float32), (5, 2, 96, torch.float32),
                                              (17, 4, 32, torch.bfloat16)])
def test_write_kv_matches_twin(rows, hkv, d, dtype):
    g = torch.Generator().manual_seed(rows)
    n, b = 6, 16
    k = torch.randn(rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(rows, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(n * b, generator=g)[:rows]
    slots[::3] = -1  # skipped rows
    caches = [torch.randn(n, b, hkv, d, generator=g).to(dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    write_kv_ref(k, v, ref[0], ref[1], slots)
    write_kv_triton(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    written = slots[slots >= 0]
    assert torch.equal(ref[0].view(-1, hkv, d)[written], k[slots >= 0])
