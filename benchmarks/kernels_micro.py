"""GPU micro-benchmark of the norm / activation / GEMV kernels: achieved GB/s vs measured copy bandwidth.

    python benchmarks/kernels_micro.py [norm] [act] [gemv]      (all three without arguments)

Each line: kernel, shape, time per call (CUDA-graph replay, so launch overhead is excluded), bytes moved
(each input read once + each output written once), GB/s and % of the device-to-device copy bandwidth
measured at the start of the same run. The same for the torch baseline where one exists.
Shapes: Gemma 4 26B-A4B (hidden 2816, q 16 x 256, dense MLP 2112, experts 704) and hidden 5376.
"""
from __future__ import annotations

import sys

import torch


def _time_s(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e-3


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / _time_s(lambda: b.copy_(a))


def _report(name: str, shape: str, fn, nbytes: int, peak: float) -> None:
    t = _time_s(fn)
    print(f"{name:<22} {shape:<24} {t * 1e6:9.2f} us {nbytes / t / 1e9:9.1f} GB/s {100 * nbytes / t / peak:6.1f} %")


def bench_norm(peak: float) -> None:
    from sparrow.kernels.norm import rms_norm_ref, rms_norm_triton

    for hidden in (2816, 5376):
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 16, 64, 4096):
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            r = torch.randn_like(x)
            e = x.numel() * 2
            shape = f"R={rows} H={hidden}"
            _report("rms_norm", shape, lambda: rms_norm_triton(x, w, 1e-6, gemma=True), 2 * e, peak)
            _report("rms_norm+res", shape, lambda: rms_norm_triton(x, w, 1e-6, residual=r), 4 * e, peak)
            _report("rms_norm+res+fp8", shape, lambda: rms_norm_triton(x, w, 1e-6, residual=r, fp8_out=True),
                    3 * e + e // 2, peak)
            _report("  torch twin", shape, lambda: rms_norm_ref(x, w, 1e-6, gemma=True), 2 * e, peak)
    x = torch.randn(64, 16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    _report("q_norm per head", "R=64 nH=16 D=256", lambda: rms_norm_triton(x, w, 1e-6), 2 * x.numel() * 2, peak)


def bench_act(peak: float) -> None:
    from sparrow.kernels.act import gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton, silu_and_mul_triton

    for inter in (704, 2112):
        for rows in (1, 64, 4096):
            x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
            nbytes = 3 * rows * inter * 2
            shape = f"R={rows} I={inter}"
            _report("gelu_tanh_and_mul", shape, lambda: gelu_tanh_and_mul_triton(x), nbytes, peak)
            _report("silu_and_mul", shape, lambda: silu_and_mul_triton(x), nbytes, peak)
            _report("  torch twin", shape, lambda: gelu_tanh_and_mul_ref(x), nbytes, peak)


def bench_gemv(peak: float) -> None:
    import torch.nn.functional as F

    from sparrow.kernels.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemv import gemv_fp8_triton, gemv_triton

    # (K, N): qkv of a sliding layer, o_proj, dense gate_up, dense down, LM head.
    for k, n in ((2816, 8192), (4096, 2816), (2816, 4224), (2112, 2816), (2816, 262144)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_fp8_block_ref(w)
        for rows in (1, 4, 16):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            io = 2 * rows * (k + n)
            shape = f"R={rows} K={k} N={n}"
            _report("gemv bf16", shape, lambda: gemv_triton(x, w), 2 * n * k + io, peak)
            _report("  F.linear (cuBLAS)", shape, lambda: F.linear(x, w), 2 * n * k + io, peak)
            _report("gemv fp8", shape, lambda: gemv_fp8_triton(x, wq, ws), n * k + ws.numel() * 4 + io, peak)
        del w, wq, ws


def main(which: list[str]) -> None:
    if not torch.cuda.is_available():
        print("kernels_micro: needs a CUDA GPU")
        return
    which = which or ["norm", "act", "gemv"]
    peak = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {peak / 1e9:.0f} GB/s")
    for name in which:
        {"norm": bench_norm, "act": bench_act, "gemv": bench_gemv}[name](peak)


if __name__ == "__main__":
    main(sys.argv[1:])
