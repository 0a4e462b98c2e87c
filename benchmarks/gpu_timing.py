"""Timing helpers shared by the GPU micro-benchmarks (kernels_micro.py, moe_layer.py, attention_prefill.py)."""
from __future__ import annotations

import torch


def time_s(fn, rep: int = 50) -> float:
    """Seconds per call of ``fn``, replayed from a CUDA graph (launch overhead excluded) for about ``rep`` ms."""
    import triton.testing

    fn()  # outside the capture: compile, and allocate what a first call allocates (split-K workspaces)
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e-3


def copy_bandwidth(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted) of an elementwise kernel, best of 3.
    (A plain ``copy_`` is a memcpy node inside a CUDA graph and runs far below HBM speed.)"""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    return max(2 * nbytes / time_s(lambda: torch.mul(a, 1.0, out=b)) for _ in range(3))
