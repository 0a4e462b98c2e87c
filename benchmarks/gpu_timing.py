"""Timing helpers shared by the GPU micro-benchmarks (kernels_micro.py, moe_layer.py, attention_prefill.py).

Sweeps compile one Triton variant per candidate, seconds each. ``SWEEP_SHARD=i/n`` in the environment makes a sweep
compile only (one call per candidate, no timing) its share, candidates i, i + n, ...: run n such processes at once
to fill Triton's on-disk cache, then the sweep itself times every candidate from that cache (``device_run.sh
precompile``).
"""
from __future__ import annotations

import os

import torch


def sweep_shard() -> tuple[int, int] | None:
    """(i, n) from ``SWEEP_SHARD=i/n``, or None: this process times its candidates."""
    value = os.environ.get("SWEEP_SHARD")
    if not value:
        return None
    i, n = map(int, value.split("/"))
    return i, n


def compile_share(candidates, run) -> None:
    """Under ``SWEEP_SHARD=i/n``: ``run(candidate)`` once for this process's share of ``candidates`` (compiles
    them), skipping those that fail."""
    i, n = sweep_shard()
    for idx, cand in enumerate(candidates):
        if idx % n == i:
            try:
                run(cand)
                torch.cuda.synchronize()
            except Exception:  # out of shared memory / registers: the timed sweep skips it too
                pass


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
