"""GPU micro-benchmark of the norm / activation / GEMV kernels: achieved GB/s vs measured copy bandwidth.

    python benchmarks/kernels_micro.py [norm] [act] [gemv]      (all three without arguments)
    python benchmarks/kernels_micro.py tune_gemv                 (sweep GemvConfig for GEMV_CONFIGS)
    python benchmarks/kernels_micro.py tune_gemv_fp8             (the same, FP8 weights only; tune_gemv_bf16)
    python benchmarks/kernels_micro.py tune_fp8_gemm             (sweep Fp8GemmConfig at M = 64)
    python benchmarks/kernels_micro.py tune_w8a8                 (W8A8 GEMV tiles vs W8A16, fp8_gemm, cuBLAS)
    python benchmarks/kernels_micro.py tune_w8a8_launch          (the shipped W8A8 tile's warps / stages / split-K)
    python benchmarks/kernels_micro.py fp8_linears               (every FP8 linear kernel by row count, with
                                                                  cuBLAS's block-scaled FP8 GEMM)
    python benchmarks/kernels_micro.py int4                      (4-bit linears: int4 and NVFP4 W4A16 at 1-16 rows
                                                                  and 2,048, FP8 beside; % = of the bytes bound)
    python benchmarks/kernels_micro.py tune_int4                 (sweep Int4Config for INT4_CONFIGS' GEMV entry)
    python benchmarks/kernels_micro.py tune_w4_fma               (the FMA GEMV tiles at 1-8 rows, int4 and NVFP4,
                                                                  against the shipped entry)
    python benchmarks/kernels_micro.py w4_prefill                (4-bit linears at 128-16,384 rows: kernel vs
                                                                  dequantize + cuBLAS, for int4.DEQUANT_MIN_ROWS)
    python benchmarks/kernels_micro.py router_logits             (Gemma 4's router logits: kernel vs torch)
    python benchmarks/kernels_micro.py tune_router_logits        (its tiles and H splits above 16 rows)
    python benchmarks/kernels_micro.py lora                      (multi-LoRA lora_delta at decode shapes, 8 rank-16
                                                                  adapters; % = of the bytes that must be read)
    python benchmarks/kernels_micro.py tune_lora                 (sweep sparrow.kernels.lora.lora's tile constants;
                                                                  prints a ROW_TILES table per row count too)

Each line: kernel, shape, time per call (CUDA-graph replay, so launch overhead is excluded), bytes moved
(each input read once + each output written once), GB/s and % of the device-to-device copy bandwidth
measured at the start of the same run. The same for the torch baseline where one exists. GEMV weights
rotate over copies larger than the L2 cache, so the GB/s are HBM figures.
Shapes: Gemma 4 26B-A4B (hidden 2816, q 16 x 256, dense MLP 2112, experts 704) and hidden 5376.
"""
from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_timing import compile_share, copy_bandwidth, sweep_shard, time_s  # noqa: E402  (beside this script)




def _rotating(make, nbytes: int, working_set: int = 1 << 28):
    """Enough copies of an input (``make()`` builds one of ``nbytes``) to exceed the L2 cache, and a
    function returning the next one: each call inside the captured graph then reads from HBM."""
    copies = [make() for _ in range(max(1, -(-working_set // max(nbytes, 1))))]
    state = {"i": 0}

    def next_copy():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    return next_copy


def _report(name: str, shape: str, fn, nbytes: int, peak: float) -> None:
    t = time_s(fn)
    print(f"{name:<22} {shape:<24} {t * 1e6:9.2f} us {nbytes / t / 1e9:9.1f} GB/s {100 * nbytes / t / peak:6.1f} %")


def bench_norm(peak: float) -> None:
    from sparrow.kernels.norm_rope.norm import rms_norm_ref, rms_norm_triton

    for hidden in (2816, 5376):
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 16, 64, 4096):
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            r = torch.randn_like(x)
            e = x.numel() * 2
            shape = f"R={rows} H={hidden}"
            _report("rms_norm", shape, lambda: rms_norm_triton(x, w, 1e-6, gemma=True), 2 * e, peak)
            _report("rms_norm+res", shape, lambda: rms_norm_triton(x, w, 1e-6, residual=r), 4 * e, peak)
            _report("  torch twin", shape, lambda: rms_norm_ref(x, w, 1e-6, gemma=True), 2 * e, peak)
    x = torch.randn(64, 16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    _report("q_norm per head", "R=64 nH=16 D=256", lambda: rms_norm_triton(x, w, 1e-6), 2 * x.numel() * 2, peak)


def bench_act(peak: float) -> None:
    from sparrow.kernels.activation.act import gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton, silu_and_mul_triton

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

    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_triton
    from sparrow.kernels.gemm.gemv import gemv_fp8_triton, gemv_triton

    # (K, N): qkv of a sliding layer, o_proj, dense gate_up, dense down, LM head.
    for k, n in GEMV_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w_next = _rotating(lambda: w.clone(), 2 * n * k)
        wq_next = _rotating(lambda: quantize_fp8_block_ref(w), n * k)
        ws_bytes = -(-n // 128) * -(-k // 128) * 4
        for rows in (1, 4, 16):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            io = 2 * rows * (k + n)
            shape = f"R={rows} K={k} N={n}"
            _report("gemv bf16", shape, lambda: gemv_triton(x, w_next()), 2 * n * k + io, peak)
            _report("  F.linear (cuBLAS)", shape, lambda: F.linear(x, w_next()), 2 * n * k + io, peak)
            _report("gemv fp8", shape, lambda: gemv_fp8_triton(x, *wq_next()), n * k + ws_bytes + io, peak)
            _report("  fp8_gemm (W8A8)", shape, lambda: fp8_gemm_triton(x, *wq_next()), n * k + ws_bytes + io, peak)
        del w, w_next, wq_next


# (K, N): qkv of a sliding layer, o_proj, dense gate_up, dense down, LM head (Gemma 4 26B-A4B).
GEMV_SHAPES = ((2816, 8192), (4096, 2816), (2816, 4224), (2112, 2816), (2816, 262144))


def _sweep(configs, forced_config, call) -> list:
    """[(seconds per call, config)] fastest first, each config forced around ``call``; configs that fail to
    compile or launch (out of shared memory / registers) are left out. Under ``SWEEP_SHARD`` only this process's
    share is compiled, and nothing is timed ([])."""
    if sweep_shard():
        def once(cfg):
            with forced_config(cfg):
                call()
        compile_share(configs, once)
        return []
    results = []
    for cfg in configs:
        with forced_config(cfg):
            try:
                results.append((time_s(call, rep=20), cfg))
            except Exception:
                continue
    return sorted(results, key=lambda r: r[0])


def tune_gemv(peak: float, dtypes=(False, True)) -> None:
    """Sweep GemvConfig per shape: tensor-core tiles x split-K at R = 1 and 8 (bf16 and / or FP8 weights);
    print the best few, to fill GEMV_CONFIGS / FP8_GEMV_CONFIGS."""
    import itertools

    import torch.nn.functional as F

    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.gemv import GemvConfig, forced_config, gemv_fp8_triton, gemv_triton

    splits = (1, 2, 4, 8)
    dot = [GemvConfig(bn, bk, split_k=sk) for bn, bk, sk in itertools.product((32, 64), (256, 512), splits)]

    for (k, n), fp8 in itertools.product(((2816, 8192), (4096, 2816), (2112, 2816), (2816, 4224)), dtypes):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nxt = _rotating(lambda: quantize_fp8_block_ref(w), n * k) if fp8 else _rotating(lambda: (w.clone(),), 2 * n * k)
        fn = gemv_fp8_triton if fp8 else gemv_triton
        nbytes = n * k * (1 if fp8 else 2)
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            results = _sweep(dot, forced_config, lambda: fn(x, *nxt()))
            if not fp8:
                t = time_s(lambda: F.linear(x, *nxt()), rep=20)
                print(f"tune cuBLAS R={rows:<2} K={k} N={n}: {t * 1e6:6.1f} us {nbytes / t / 1e9:7.1f} GB/s "
                      f"{100 * nbytes / t / peak:5.1f} %", flush=True)
            for t, cfg in results[:4] + [r for r in results if r[1].split_k == 1][:1]:
                programs = -(-n // cfg.block_n) * cfg.split_k
                print(f"tune {'fp8 ' if fp8 else 'bf16'} R={rows:<2} K={k} N={n}: {t * 1e6:6.1f} us "
                      f"{nbytes / t / 1e9:7.1f} GB/s {100 * nbytes / t / peak:5.1f} %  programs {programs:4d}  {cfg}",
                      flush=True)


# (N, K) of the 4-bit micro-benchmark: Gemma 4 26B-A4B's q projection, o_proj, and an 8192-wide output.
INT4_SHAPES = ((4096, 2816), (2816, 4096), (8192, 2816))


def _w4_weights(n: int, k: int):
    """(bf16 w [N, K], int4 next-copy fn -> (packed, scale, None, 128), NVFP4 next-copy fn -> (codes, scale, g),
    int4 bytes, NVFP4 bytes)."""
    from sparrow.kernels.gemm.int4 import quantize_int4_ref
    from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    packed, scale, _ = quantize_int4_ref(w, 128, True, torch.bfloat16)
    codes, s4, g2 = quantize_nvfp4_ref(w)
    g = g2.expand(n).contiguous()
    int4_bytes, nvfp4_bytes = n * k // 2 + 2 * scale.numel(), n * k // 2 + s4.numel() + 4 * n
    int4_next = _rotating(lambda: (packed.clone(), scale.clone(), None, 128), int4_bytes)
    nvfp4_next = _rotating(lambda: (codes.clone(), s4.clone(), g), nvfp4_bytes)
    return w, int4_next, nvfp4_next, int4_bytes, nvfp4_bytes


def bench_int4(peak: float) -> None:
    """int4 and NVFP4 W4A16 linears (``int4_linear_triton``, ``nvfp4_linear_triton``) beside the FP8 path's kernels
    (W8A8 GEMV at <= 16 rows, fp8_gemm above) at 1, 2, 5, 8, 16 and 2,048 rows. Each line's % is the achieved
    fraction of the bytes bound (weights + scales + x + y at the measured copy bandwidth); the 2,048-row lines add
    TFLOP/s (the GEMMs are compute-bound there)."""
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_triton
    from sparrow.kernels.gemm.gemv import gemv_w8a8_triton
    from sparrow.kernels.gemm.int4 import int4_linear_triton
    from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear_triton

    for n, k in INT4_SHAPES:
        w, int4_next, nvfp4_next, int4_bytes, nvfp4_bytes = _w4_weights(n, k)
        fp8_bytes = n * k + 4 * -(-n // 128) * -(-k // 128)
        fp8_next = _rotating(lambda: quantize_fp8_block_ref(w), fp8_bytes)
        for rows in (1, 2, 5, 8, 16, 2048):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            io = 2 * rows * (k + n)
            shape = f"R={rows} N={n} K={k}"
            fp8 = (lambda: gemv_w8a8_triton(x, *fp8_next())) if rows <= 16 else (lambda: fp8_gemm_triton(x, *fp8_next()))
            for name, fn, nbytes in (("int4 W4A16", lambda: int4_linear_triton(x, *int4_next()), int4_bytes),
                                     ("nvfp4 W4A16", lambda: nvfp4_linear_triton(x, *nvfp4_next()), nvfp4_bytes),
                                     ("  fp8 (W8A8)", fp8, fp8_bytes)):
                if rows <= 16:
                    _report(name, shape, fn, nbytes + io, peak)
                else:
                    t = time_s(fn)
                    print(f"{name:<22} {shape:<24} {t * 1e6:9.2f} us {2 * rows * n * k / t / 1e12:9.1f} TFLOP/s",
                          flush=True)
        del w, int4_next, nvfp4_next, fp8_next


def w4_prefill(peak: float) -> None:
    """4-bit linears at prefill row counts (128 .. 16,384), us a call: ``w4_matmul_kernel`` against the dequantize
    path (``int4.w4_dequantize`` then F.linear, what ``int4.DEQUANT_MIN_ROWS`` switches to), int4 and NVFP4, beside
    cuBLAS's block-scaled FP8 GEMM with its quantizer (the FP8 checkpoints' prefill) and cuBLAS bf16; the
    dequantize step alone last. Fill DEQUANT_MIN_ROWS with the first row count where the dequantize path wins."""
    import torch.nn.functional as F

    from sparrow.kernels.gemm import int4 as int4_mod
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear_triton
    from sparrow.kernels.gemm.scaled_mm import fp8_scaled_mm, scaled_mm_supported

    shipped = int4_mod.DEQUANT_MIN_ROWS
    print("w4 prefill    rows     N     K | int4 kernel  int4 dequant | nvfp4 kernel  nvfp4 dequant | FP8 scaled_mm  "
          "bf16 | dequant alone (int4 / nvfp4)")
    for n, k in INT4_SHAPES:
        w, int4_next, nvfp4_next, int4_bytes, nvfp4_bytes = _w4_weights(n, k)
        nxt_mm = _rotating(lambda: _for_cublas(*quantize_fp8_block_ref(w)), n * k)
        nxt16 = _rotating(lambda: (w.clone(),), 2 * n * k)
        for rows in (128, 256, 512, 1024, 2048, 8192, 16384):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t = {}
            for side, bound in (("kernel", 1 << 62), ("dequant", 0)):
                int4_mod.DEQUANT_MIN_ROWS = bound
                t["int4 " + side] = time_s(lambda: int4_mod.int4_linear_triton(x, *int4_next()), rep=20)
                t["nvfp4 " + side] = time_s(lambda: nvfp4_linear_triton(x, *nvfp4_next()), rep=20)
            int4_mod.DEQUANT_MIN_ROWS = shipped
            t["fp8"] = (time_s(lambda: fp8_scaled_mm(x, *nxt_mm()), rep=20)
                        if scaled_mm_supported(x.device) else float("nan"))
            t["bf16"] = time_s(lambda: F.linear(x, *nxt16()), rep=20)
            print(f"w4 prefill {rows:7d} {n:5d} {k:5d} | {t['int4 kernel'] * 1e6:11.1f} {t['int4 dequant'] * 1e6:13.1f} | "
                  f"{t['nvfp4 kernel'] * 1e6:12.1f} {t['nvfp4 dequant'] * 1e6:14.1f} | {t['fp8'] * 1e6:13.1f} "
                  f"{t['bf16'] * 1e6:5.1f}", flush=True)
        p, s, _, _ = int4_next()
        c, s4, g4 = nvfp4_next()
        dq_int4 = time_s(lambda: int4_mod.w4_dequantize(p, s, None, None, 128, torch.bfloat16), rep=20)
        dq_nv = time_s(lambda: int4_mod.w4_dequantize(c.view(torch.int32), s4, None, g4, 16, torch.bfloat16), rep=20)
        print(f"w4 dequantize N={n} K={k}: int4 {dq_int4 * 1e6:.1f} us ({(int4_bytes + 2 * n * k) / dq_int4 / peak:.0%} "
              f"of copy bandwidth), nvfp4 {dq_nv * 1e6:.1f} us ({(nvfp4_bytes + 2 * n * k) / dq_nv / peak:.0%})",
              flush=True)
        del w, int4_next, nvfp4_next, nxt_mm, nxt16


def tune_int4(peak: float) -> None:
    """Sweep Int4Config (swapped and plain dots, BLOCK_N x BLOCK_K x split-K, stages; BLOCK_M 16) at R = 1 and 8
    per INT4_SHAPES shape; print the best few, to fill INT4_CONFIGS' GEMV entry."""
    import itertools

    from sparrow.kernels.gemm.int4 import Int4Config, forced_config, int4_linear_triton

    configs = [Int4Config(16, bn, bk, split_k=sk, swap_ab=True)
               for bn, bk, sk in itertools.product((64, 128), (128, 256), (0, 1, 2, 4))]
    configs += [Int4Config(16, bn, bk, split_k=sk) for bn, bk, sk in itertools.product((32, 64), (128, 256), (0, 1))]
    configs += [Int4Config(16, 64, 128, num_stages=s, split_k=0, swap_ab=True) for s in (2, 4, 5)]
    for n, k in INT4_SHAPES:
        _, int4_next, _, nbytes, _ = _w4_weights(n, k)
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            results = _sweep(configs, forced_config, lambda: int4_linear_triton(x, *int4_next()))
            for t, cfg in results[:4]:
                print(f"tune int4 R={rows:<2} N={n} K={k}: {t * 1e6:6.1f} us {nbytes / t / 1e9:7.1f} GB/s "
                      f"{100 * nbytes / t / peak:5.1f} %  {cfg}", flush=True)


def tune_w4_fma(peak: float) -> None:
    """The FMA GEMV tiles (``Int4Config.fma``: no dots, BLOCK_M = the rows rounded up to a power of two) against the
    entry ``int4.pick_config`` gives now, int4 and NVFP4, at ``W4_FMA_ROWS`` (environment, default "1 4") rows:
    BLOCK_N x warps x BLOCK_K (int4: 128, its group) x split-K on each INT4_SHAPES shape (the current entry's time
    and the best three printed per shape), then the tile of least total time over the shapes; where it beats the
    current entry it is written into the format's tuned file for this device (``int4.config_file``, read by
    ``pick_config``)."""
    import collections
    import dataclasses
    import itertools
    import json
    import os

    from sparrow.kernels.gemm import int4
    from sparrow.kernels.gemm.int4 import Int4Config, forced_config, int4_linear_triton, pick_config
    from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear_triton

    device = torch.cuda.get_device_name()
    weights = {(n, k): _w4_weights(n, k) for n, k in INT4_SHAPES}
    for fmt in ("int4", "nvfp4"):
        table = {}
        for rows in map(int, os.environ.get("W4_FMA_ROWS", "1 4").split()):
            current = pick_config(rows, fmt, device)
            configs = [current] + [Int4Config(1 << (rows - 1).bit_length(), bn, bk, num_warps=w, split_k=sk, fma=True)
                                   for (bn, w), bk, sk in itertools.product(((32, 4), (64, 4), (128, 4), (128, 8)),
                                                                            (128,) if fmt == "int4" else (128, 256),
                                                                            (0, 2, 4, 8))]
            totals, counts = collections.defaultdict(float), collections.Counter()
            for (n, k), (_, int4_next, nvfp4_next, int4_bytes, nvfp4_bytes) in weights.items():
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                if fmt == "int4":
                    fn, nbytes = (lambda: int4_linear_triton(x, *int4_next())), int4_bytes
                else:
                    fn, nbytes = (lambda: nvfp4_linear_triton(x, *nvfp4_next())), nvfp4_bytes
                results = _sweep(configs, forced_config, fn)
                for t, cfg in results:
                    totals[cfg] += t
                    counts[cfg] += 1
                for tag, (t, cfg) in [("current", r) for r in results if r[1] == current] + [
                        ("best", r) for r in results[:3]]:
                    print(f"tune_w4_fma {fmt:<5} R={rows} N={n} K={k} {tag:<7}: {t * 1e6:6.1f} us "
                          f"{100 * nbytes / t / peak:5.1f} %  {cfg}", flush=True)
            complete = {c: t for c, t in totals.items() if counts[c] == len(weights)}
            if not complete:  # compiling only (SWEEP_SHARD), or nothing ran
                continue
            best = min(complete, key=complete.get)
            print(f"tune_w4_fma {fmt:<5} R={rows} total over the shapes: best {complete[best] * 1e6:6.1f} us, current "
                  f"{complete.get(current, float('nan')) * 1e6:6.1f} us  {best}", flush=True)
            if best != current:
                table[str(rows)] = dataclasses.asdict(best)
        if table:
            path = int4.config_file(fmt, device)
            old = json.loads(path.read_text())["configs"] if path.is_file() else {}
            configs_out = dict(sorted({**old, **table}.items(), key=lambda kv: int(kv[0])))
            path.write_text(json.dumps({"meta": {"device": device, "torch": torch.__version__, "source":
                                                 "benchmarks/kernels_micro.py tune_w4_fma (least total over "
                                                 "INT4_SHAPES)"}, "configs": configs_out}, indent=1) + "\n")
            int4.tuned_configs.cache_clear()
            print(f"tune_w4_fma: wrote {path}", flush=True)


def tune_fp8_gemm(peak: float) -> None:
    """Sweep Fp8GemmConfig (tiles, split-K) at decode-sized M = 64; print the best few per shape."""
    import itertools

    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.fp8_gemm import Fp8GemmConfig, fp8_gemm_triton, forced_config

    configs = [Fp8GemmConfig(block_m=bm, block_n=bn, group_m=8, num_warps=4, num_stages=stages, split_k=split)
               for bm, bn, split, stages in itertools.product((32, 64), (32, 64, 128), (1, 2, 4, 8), (3, 4))]
    for k, n in ((2816, 8192), (4096, 2816), (2112, 2816), (2816, 4224)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nxt = _rotating(lambda: quantize_fp8_block_ref(w), n * k)
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        results = _sweep(configs, forced_config, lambda: fp8_gemm_triton(x, *nxt()))
        for t, cfg in results[:4] + [r for r in results if r[1].split_k == 1][:1]:
            print(f"tune fp8_gemm M=64  K={k} N={n}: {t * 1e6:6.1f} us {n * k / t / 1e9:7.1f} GB/s "
                  f"{100 * n * k / t / peak:5.1f} %  {cfg}", flush=True)


def tune_fp8_rows(peak: float) -> None:
    """FP8 linears at 32 and 64 rows (decode batches past the GEMV's 16): the W8A8 ``fp8_gemm`` (its table
    config) against the W8A16 GEMV with rows padded to 32 / 64 (swept, swapped dots included) and cuBLAS on
    the bf16 weight."""
    import itertools

    import torch.nn.functional as F

    from sparrow.kernels.gemm import gemv
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_triton

    configs = [gemv.GemvConfig(bn, bk, num_warps=warps, split_k=sk) for bn, bk, sk, warps
               in itertools.product((32, 64), (128, 256), (0, 1), (4,))]
    # swapped dots: the widened weight tile as the wgmma's M side (64 / 128 rows), the rows as its N side
    configs += [gemv.GemvConfig(bn, bk, num_warps=4, split_k=sk, swap_ab=True) for bn, bk, sk
                in itertools.product((64, 128), (128, 256), (0, 1))]
    table = gemv.FP8_GEMV_CONFIGS
    gemv.FP8_GEMV_CONFIGS = ((64, table[-1][1]),)  # let the launcher take 64 rows
    try:
        for k, n in ((2816, 8192), (4096, 2816), (2112, 2816), (2816, 4224)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            nxt = _rotating(lambda: quantize_fp8_block_ref(w), n * k)
            nxt16 = _rotating(lambda: (w.clone(),), 2 * n * k)
            for rows in (32, 64):
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                t_gemm = time_s(lambda: fp8_gemm_triton(x, *nxt()), rep=20)
                t_cublas = time_s(lambda: F.linear(x, *nxt16()), rep=20)
                results = _sweep(configs, gemv.forced_config, lambda: gemv.gemv_fp8_triton(x, *nxt()))
                print(f"fp8 rows R={rows} K={k} N={n}: fp8_gemm {t_gemm * 1e6:6.1f} us "
                      f"({100 * n * k / t_gemm / peak:4.1f} %)  cuBLAS bf16 {t_cublas * 1e6:6.1f} us", flush=True)
                for t, cfg in results[:3]:
                    print(f"    W8A16 GEMV {t * 1e6:6.1f} us ({100 * n * k / t / peak:4.1f} %)  {cfg}", flush=True)
    finally:
        gemv.FP8_GEMV_CONFIGS = table


def tune_w8a8(peak: float) -> None:
    """FP8 linears, W8A8 GEMV (x quantized in registers, e4m3 tensor-core dots, swapped operands) against
    the W8A16 GEMV (FP8_GEMV_CONFIGS), fp8_gemm and cuBLAS on the bf16 weight, at rows 1 / 8 / 16; the last
    two shapes hold the bytes of 8 experts' gate|up and down (Gemma 4 26B-A4B), as one dense weight."""
    import itertools

    import torch.nn.functional as F

    from sparrow.kernels.gemm import gemv
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_triton

    swap = [gemv.GemvConfig(bn, bk, num_stages=st, swap_ab=True, split_k=sk) for bn, bk, st, sk
            in itertools.product((64, 128), (128, 256, 512), (3, 4), (0,))]
    shapes = ((2816, 8192), (4096, 2816), (2112, 2816), (2816, 4224), (2816, 8 * 1408), (704, 8 * 2816))
    for k, n in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nxt = _rotating(lambda: quantize_fp8_block_ref(w), n * k)
        nxt16 = _rotating(lambda: (w.clone(),), 2 * n * k)
        for rows in (1, 8, 16):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            pct = lambda t: 100 * n * k / t / peak  # noqa: E731  (% of copy bandwidth, FP8 weight bytes)
            t_a16 = time_s(lambda: gemv.gemv_fp8_triton(x, *nxt()), rep=20)
            t_gemm = time_s(lambda: fp8_gemm_triton(x, *nxt()), rep=20)
            t_cublas = time_s(lambda: F.linear(x, *nxt16()), rep=20)
            print(f"w8a8 R={rows:<2} K={k} N={n}: W8A16 GEMV {t_a16 * 1e6:6.1f} us ({pct(t_a16):4.1f} %)  fp8_gemm "
                  f"{t_gemm * 1e6:6.1f} us  cuBLAS bf16 {t_cublas * 1e6:6.1f} us ({2 * pct(t_cublas):4.1f} %)", flush=True)
            results = _sweep(swap, gemv.forced_config, lambda: gemv.gemv_w8a8_triton(x, *nxt()))
            for t, cfg in results[:3]:
                print(f"    W8A8 GEMV {t * 1e6:6.1f} us ({pct(t):4.1f} %)  {cfg}", flush=True)
        del w, nxt, nxt16


def tune_w8a8_launch(peak: float) -> None:
    """The shipped W8A8 GEMV tile (W8A8_GEMV_CONFIGS) at the four dense Gemma 4 shapes, rows 1 and 8, then a
    coordinate search from it over the launch parameters the earlier sweeps held fixed: num_warps x num_stages,
    then split-K (the automatic one fills split_k.FILL_PROGRAMS programs), then block_n x block_k."""
    import dataclasses
    import itertools

    from sparrow.kernels.gemm import gemv
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref

    shipped = gemv.W8A8_GEMV_CONFIGS[-1][1]
    for (k, n), rows in itertools.product(((2816, 8192), (4096, 2816), (2112, 2816), (2816, 4224)), (1, 8)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nxt = _rotating(lambda: quantize_fp8_block_ref(w), n * k)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        call = lambda: gemv.gemv_w8a8_triton(x, *nxt())  # noqa: E731
        best_t, best = _sweep([shipped], gemv.forced_config, call)[0]
        t_shipped = best_t
        steps = ([dict(num_warps=nw, num_stages=ns) for nw, ns in itertools.product((2, 4, 8), (2, 3, 4, 5, 6))],
                 [dict(split_k=sk) for sk in (0, 1, 2, 3, 4, 6, 8)],
                 [dict(block_n=bn, block_k=bk) for bn, bk in itertools.product((64, 128), (128, 256, 512))])
        for step in steps:
            results = _sweep([dataclasses.replace(best, **c) for c in step], gemv.forced_config, call)
            if results and results[0][0] < best_t:
                best_t, best = results[0]
        pct = lambda t: 100 * n * k / t / peak  # noqa: E731
        print(f"w8a8 launch R={rows} K={k} N={n}: shipped {t_shipped * 1e6:6.1f} us ({pct(t_shipped):4.1f} %), "
              f"best {best_t * 1e6:6.1f} us ({pct(best_t):4.1f} %)  {best}", flush=True)
        del w, nxt


def _for_cublas(wq: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scales in cuBLAS's layout) from a block-quantized weight."""
    from sparrow.kernels.gemm.scaled_mm import scaled_mm_weight_scale

    return wq, scaled_mm_weight_scale(ws)


def _cublas_gemm(q: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws_mm: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaled GEMM alone, on activations already quantized (M-major scales)."""
    import torch.nn.functional as F

    return F.scaled_mm(q, wq.t(), xs, F.ScalingType.BlockWise1x128, ws_mm, F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)


def fp8_linears(peak: float) -> None:
    """FP8 linears at Gemma 4's dense shapes from 1 to 16,384 rows, us a call: the W8A8 GEMV (<= 16 rows), the
    W8A16 GEMV (<= 64), the Triton ``fp8_gemm``, cuBLAS's block-scaled FP8 GEMM with its activation quantizer
    (``fp8_scaled_mm``) and without it, and cuBLAS on the bf16 weight; then whether cuBLAS takes K = 2112
    (not a multiple of 128) with ceil-sized scales."""
    import torch.nn.functional as F

    from sparrow.kernels.gemm import gemv
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref
    from sparrow.kernels.gemm.fp8_gemm import fp8_gemm_ref, fp8_gemm_triton
    from sparrow.kernels.gemm.scaled_mm import fp8_scaled_mm, quantize_fp8_per_group, scaled_mm_supported

    if not scaled_mm_supported(torch.device("cuda")):
        print(f"fp8_linears: cuBLAS block-scaled FP8 GEMM not available (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda})")
        return
    print("fp8 linear  rows     K     N |  W8A8 GEMV  W8A16 GEMV  fp8_gemm  scaled_mm (GEMM only)  cuBLAS bf16 | "
          "best FP8 % of bound")
    for k, n in ((2816, 8192), (4096, 2816), (2816, 4224), (2816, 2816)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nxt = _rotating(lambda: quantize_fp8_block_ref(w), n * k)
        nxt_mm = _rotating(lambda: _for_cublas(*quantize_fp8_block_ref(w)), n * k)
        nxt16 = _rotating(lambda: (w.clone(),), 2 * n * k)
        for rows in (1, 8, 16, 17, 32, 64, 128, 512, 2048, 16384):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t = {}
            if rows <= 16:
                t["w8a8"] = time_s(lambda: gemv.gemv_w8a8_triton(x, *nxt()), rep=20)
            if rows <= 64:
                t["w8a16"] = time_s(lambda: gemv.gemv_fp8_triton(x, *nxt()), rep=20)
            t["fp8_gemm"] = time_s(lambda: fp8_gemm_triton(x, *nxt()), rep=20)
            t["scaled_mm"] = time_s(lambda: fp8_scaled_mm(x, *nxt_mm()), rep=20)
            m4 = -(-rows // 4) * 4
            q, xs = quantize_fp8_per_group(x, m4, scales_m_major=True)
            t["gemm_only"] = time_s(lambda: _cublas_gemm(q, xs, *nxt_mm()), rep=20)
            t["cublas"] = time_s(lambda: F.linear(x, *nxt16()), rep=20)
            fp8_best = min(v for key, v in t.items() if key not in ("gemm_only", "cublas"))
            cells = "  ".join(f"{t[key] * 1e6:8.1f}" if key in t else f"{'-':>8}"
                              for key in ("w8a8", "w8a16", "fp8_gemm", "scaled_mm", "gemm_only", "cublas"))
            print(f"fp8 linear {rows:5d} {k:5d} {n:5d} | {cells} | {100 * n * k / fp8_best / peak:5.1f} %", flush=True)
        del w, nxt, nxt_mm, nxt16
    # K not a multiple of 128 (Gemma 4's dense down projection, K = 2112): ceil-sized scales, padded to 4
    k, n, rows = 2112, 2816, 64
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_fp8_block_ref(torch.randn(n, k, device="cuda") / k**0.5)
    q, xs = quantize_fp8_per_group(x, rows, scales_m_major=True)
    try:
        y = _cublas_gemm(q, xs, *_for_cublas(wq, ws))
        ref = fp8_gemm_ref(x, wq, ws).float()
        print(f"scaled_mm K={k}: runs, NMSE against fp8_gemm_ref {float(((y.float() - ref) ** 2).mean() / (ref ** 2).mean()):.2e}")
    except Exception as e:  # noqa: BLE001  (a probe: report what cuBLAS / torch says)
        print(f"scaled_mm K={k}: refused: {type(e).__name__}: {str(e)[:300]}")


def bench_router_logits(peak: float) -> None:
    """Gemma 4's router logits (bf16 x [R, 2816], fp32 folded weight [128, 2816], the scale-free RMSNorm
    folded in) by row count: the Triton kernel (the layers use it up to MAX_LOGIT_ROWS) against the twin
    (torch: cast, norm, cuBLAS fp32 matmul), us a call."""
    from sparrow.kernels.moe.router import MAX_LOGIT_ROWS, router_logits_ref, router_logits_triton

    w = torch.randn(128, 2816, device="cuda") / 2816**0.5
    for rows in (1, 8, 16, 17, 32, 64, 128, 256, 1024):
        x = torch.randn(rows, 2816, device="cuda", dtype=torch.bfloat16)
        t = time_s(lambda: router_logits_triton(x, w, 1e-6), rep=20)
        t_ref = time_s(lambda: router_logits_ref(x, w, 1e-6), rep=20)
        err = float((router_logits_triton(x, w, 1e-6) - router_logits_ref(x, w, 1e-6)).abs().max())
        used = "used" if rows <= MAX_LOGIT_ROWS else "not used"
        print(f"router_logits R={rows:<5} kernel ({used}) {t * 1e6:7.1f} us  torch {t_ref * 1e6:7.1f} us  "
              f"max |diff| {err:.1e}  ({100 * w.numel() * 4 / t / peak:4.1f} % of copy bandwidth on the weight)",
              flush=True)


def tune_router_logits(peak: float) -> None:
    """Gemma 4's router logits above 16 rows: ``router_logits_kernel`` tiles (rows x experts x H step, H split
    over programs or not) against torch's matmul and the table's entry, us a call; the best three per row count."""
    import itertools

    from sparrow.kernels.moe.router import LogitsConfig, forced_logits_config, router_logits_ref, router_logits_triton

    tiles = [(br, be, bh, 4) for br, be, bh in itertools.product((16, 32), (4, 8, 16), (32, 64, 128))
             if br * bh * (be + 1) <= 12288]
    tiles += [(32, 8, 64, 8), (16, 16, 64, 8), (32, 16, 32, 8)]
    configs = [LogitsConfig(br, be, bh, split_k=sk, num_warps=nw) for (br, be, bh, nw), sk in itertools.product(tiles, (0, 1))]
    w = torch.randn(128, 2816, device="cuda") / 2816**0.5
    for rows in (17, 32, 64, 128, 256, 1024):
        x = torch.randn(rows, 2816, device="cuda", dtype=torch.bfloat16)
        t_ref = time_s(lambda: router_logits_ref(x, w, 1e-6), rep=20)
        t_table = time_s(lambda: router_logits_triton(x, w, 1e-6), rep=20)
        results = _sweep(configs, forced_logits_config, lambda: router_logits_triton(x, w, 1e-6))
        print(f"router_logits tiles R={rows:<5} torch {t_ref * 1e6:7.1f} us  table entry {t_table * 1e6:7.1f} us", flush=True)
        for t, cfg in results[:3]:
            print(f"    {t * 1e6:7.1f} us  {cfg}", flush=True)


# lora_delta at Gemma 4 26B-A4B decode shapes, 8 adapters of rank 16 (max_lora_rank 16):
# (name, K, out_sizes, width, experts, rank layout) - "blocks": side-by-side shards of rank 16 (B block-diagonal),
# "dense": one rank-16 factor over all outputs (PEFT's fused 3-D expert tensor).
LORA_SHAPES = (("qkv", 2816, (4096, 2048, 2048), 48, 1, "blocks"), ("o_proj", 4096, (2816,), 16, 1, "blocks"),
               ("expert gate_up", 2816, (704, 704), 32, 128, "dense"), ("expert down", 704, (2816,), 16, 128, "blocks"))
LORA_SLOTS, LORA_RANK, LORA_TOP_K = 8, 16, 8


def _lora_case(shape, rows: int, device: str = "cuda", draws: int = 16):
    """(call-next function, bytes that must be read + written a call, label) of one LoRA shape at ``rows`` decode
    rows: rows over 8 adapters (row i: slot (i + j) mod 8 in draw j; 1 row: one adapter), experts: top-8 of 128
    random per row, and the layers' accumulate flag (expert gate_up writes a fresh fp32 delta). Calls rotate over
    ``draws`` (slots, expert ids) draws and over buffer copies larger than the L2 cache, so weights come from HBM."""
    from sparrow.kernels.lora.lora import lora_delta, lora_index
    from sparrow.layers.lora_buffers import LoRABuffers

    name, k, sizes, width, experts, layout = shape
    n, dev = sum(sizes), torch.device(device)
    g = torch.Generator(device=dev).manual_seed(rows)
    buf = LoRABuffers(LORA_SLOTS, experts, width, k, n, torch.bfloat16, dev, sizes)
    for s in range(LORA_SLOTS):
        shards = [LORA_RANK] * (len(sizes) if layout == "blocks" else 1)
        a = torch.randn(experts, sum(shards), k, device=dev, generator=g) / k**0.5
        b = torch.zeros(experts, n, sum(shards), device=dev)
        row = col = 0
        for size, r in zip(sizes if layout == "blocks" else (n,), shards):
            b[:, row:row + size, col:col + r] = torch.randn(experts, size, r, device=dev, generator=g) * 0.01
            row, col = row + size, col + r
        buf.write(s, (a[0], b[0]) if experts == 1 else (a, b))
    p = rows * (LORA_TOP_K if experts > 1 else 1)
    x_rows = p if name == "expert down" else rows
    accumulate = name != "expert gate_up"
    x = torch.randn(x_rows, k, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(p, n, device=dev, dtype=torch.bfloat16 if accumulate else torch.float32)
    cols, need, picks = buf.seg_cols.tolist(), 0, []
    for j in range(draws):
        slots = ((torch.arange(rows, device=dev) + j) % LORA_SLOTS).to(torch.int32)
        kw = dict(out_sizes=buf.out_sizes, seg_cols=buf.seg_cols, accumulate=accumulate)
        if experts > 1:
            ids = torch.rand(rows, experts, device=dev, generator=g).topk(LORA_TOP_K, dim=-1).indices.to(torch.int32)
            kw.update(expert_ids=ids, num_experts=experts, slot_div=LORA_TOP_K, x_div=p // x_rows)
        picks.append((slots, kw))
        idx = lora_index(slots, kw.get("expert_ids"), experts, LORA_TOP_K if experts > 1 else 1)
        for w in torch.unique(idx[idx >= 0]).tolist():  # each distinct weight set's used A rows and B rank rows
            s = w // experts
            need += int(buf.ranks[s]) * k * 2 + sum(m * size * 2 for (_, m), size in zip(cols[s], sizes))
    need = need // draws + x.numel() * 2 + out.numel() * out.element_size() * (2 if accumulate else 1)
    weights = _rotating(lambda: (buf.a.clone(), buf.b.clone()), buf.nbytes, working_set=1 << 30)
    state = {"j": 0}

    def call():
        (a, b), (slots, kw) = weights(), picks[state["j"] % draws]
        state["j"] += 1
        return lora_delta(x, a, b, slots, buf.ranks, out, **kw)

    label = f"R={rows} P={p} K={k} N={n} W={width}" + (f" E={experts}" if experts > 1 else "")
    return call, need, label


def bench_lora(peak: float) -> None:
    """lora_delta (split-K shrink + segment expand) at Gemma 4's decode shapes with 8 rank-16 adapters, rows 1 / 8 /
    64: us a call (both launches, CUDA-graph replay), the bytes that must be read and written (distinct weight
    sets' used A and B rows, x, out) and their GB/s and % of the copy bandwidth."""
    for shape in LORA_SHAPES:
        for rows in (1, 8, 64):
            call, need, label = _lora_case(shape, rows)
            t = time_s(call, rep=20)
            print(f"lora {shape[0]:<15} {label:<40} {t * 1e6:8.2f} us {need / 1e6:8.2f} MB {need / t / 1e9:8.1f} GB/s "
                  f"{100 * need / t / peak:6.1f} %", flush=True)
        torch.cuda.empty_cache()


# tune_lora's grid: shrink (SPLIT_K_CHUNK, SHRINK_TILE, SHRINK_WARPS), then expand (EXPAND_BLOCK_N, EXPAND_TILE,
# EXPAND_WARPS) with the best shrink. A chunk of 1 << 20: no split.
LORA_SHRINK_SWEEP = [dict(SPLIT_K_CHUNK=c, SHRINK_TILE=t, SHRINK_WARPS=w) for c in (128, 256, 512, 1 << 20)
                     for t, w in ((4096, 4), (8192, 4), (8192, 8))]
LORA_EXPAND_SWEEP = [dict(EXPAND_BLOCK_N=bn, EXPAND_TILE=t, EXPAND_WARPS=w) for bn, t, w in
                     ((128, 4096, 4), (256, 4096, 4), (256, 4096, 8), (512, 8192, 4), (512, 8192, 8),
                      (1024, 16384, 8))]


def tune_lora(peak: float) -> None:
    """Sweep sparrow.kernels.lora.lora's tile constants over LORA_SHAPES x rows 1 / 8 / 64 (``ROW_TILES`` off): the
    shrink's, then the expand's with the best shrink; per case the best setting, the setting of least total time
    over all cases (the constants), with its total against the defaults', and a ``ROW_TILES`` table: per launch
    row count P (rows, or rows x top-k pairs) the shrink and the expand settings of least total over its cases."""
    from sparrow.kernels.lora import lora as lk

    names = [k for d in (LORA_SHRINK_SWEEP[0], LORA_EXPAND_SWEEP[0]) for k in d]
    default = {k: getattr(lk, k) for k in names}
    cases = [(shape, rows) for shape in LORA_SHAPES for rows in (1, 8, 64)]
    built = [_lora_case(shape, rows) for shape, rows in cases]
    pairs = [rows * (LORA_TOP_K if shape[4] > 1 else 1) for shape, rows in cases]  # P of each case's launches
    shipped_row_tiles, lk.ROW_TILES = lk.ROW_TILES, ()
    table = {p: {} for p in sorted(set(pairs))}

    def run(settings) -> list[float]:
        for key, v in {**default, **settings}.items():
            setattr(lk, key, v)
        try:
            return [time_s(call, rep=10) for call, _, _ in built]
        except Exception as e:  # noqa: BLE001  (a setting that does not compile or launch: left out)
            print(f"    {settings}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return [float("inf")] * len(built)
        finally:
            for key, v in default.items():
                setattr(lk, key, v)

    base = run({})
    best_shrink = {}
    for label, sweep, fixed in (("shrink", LORA_SHRINK_SWEEP, lambda: {}),
                                ("expand", LORA_EXPAND_SWEEP, lambda: best_shrink)):
        results = [(run({**fixed(), **cfg}), {**fixed(), **cfg}) for cfg in sweep]
        print(f"tune_lora {label}:", flush=True)
        for j, (shape, rows) in enumerate(cases):
            times, cfg = min(results, key=lambda r: r[0][j])
            print(f"  {shape[0]:<15} R={rows:<3} default {base[j] * 1e6:7.2f} us  best {times[j] * 1e6:7.2f} us  {cfg}",
                  flush=True)
        times, cfg = min(results, key=lambda r: sum(r[0]))
        print(f"  least total: {sum(times) * 1e6:8.2f} us (defaults {sum(base) * 1e6:8.2f} us)  {cfg}", flush=True)
        if label == "shrink":
            best_shrink = {k: cfg[k] for k in LORA_SHRINK_SWEEP[0]}
        sweep_names = list(sweep[0])
        for p, values in table.items():
            group = [j for j, q in enumerate(pairs) if q == p]
            _, cfg_p = min(results, key=lambda r: sum(r[0][j] for j in group))
            values.update({k: cfg_p[k] for k in sweep_names})
    lk.ROW_TILES = shipped_row_tiles
    bounds = list(table)[:-1] + ["1 << 62"]
    print("tune_lora ROW_TILES (per P, least total of its cases; the expand timed with the least-total shrink):\n"
          "ROW_TILES = (\n" + "".join(f"    ({b}, {v}),\n" for b, v in zip(bounds, table.values())) + ")", flush=True)


def main(which: list[str]) -> None:
    if not torch.cuda.is_available():
        print("kernels_micro: needs a CUDA GPU")
        return
    which = which or ["norm", "act", "gemv"]
    peak = copy_bandwidth(1 << 24 if sweep_shard() else 1 << 31)
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {peak / 1e9:.0f} GB/s")
    for name in which:
        {"norm": bench_norm, "act": bench_act, "gemv": bench_gemv, "tune_gemv": tune_gemv,
         "tune_gemv_fp8": lambda p: tune_gemv(p, (True,)),
         "tune_gemv_bf16": lambda p: tune_gemv(p, (False,)), "tune_fp8_gemm": tune_fp8_gemm,
         "tune_fp8_rows": tune_fp8_rows, "tune_w8a8": tune_w8a8, "tune_w8a8_launch": tune_w8a8_launch,
         "fp8_linears": fp8_linears, "int4": bench_int4, "tune_int4": tune_int4, "tune_w4_fma": tune_w4_fma,
         "w4_prefill": w4_prefill,
         "router_logits": bench_router_logits, "tune_router_logits": tune_router_logits, "lora": bench_lora,
         "tune_lora": tune_lora}[name](peak)


if __name__ == "__main__":
    main(sys.argv[1:])
