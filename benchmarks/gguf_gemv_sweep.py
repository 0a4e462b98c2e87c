"""Batch-1 GEMV tile sweep of the dense GGUF linear on a CUDA card (``gguf.forced_config``): for each hot type
of a Q4_K_M file at a Llama-3-8B-size shape, the default tile's (``gguf.pick_config``) and each candidate FMA
tile's time per call replayed from a CUDA graph (launch overhead excluded: decode runs as graphs) and GB/s of
weight bytes against the copy bandwidth measured here, then the best per shape as a ``gguf.config_file`` entry. Correctness is the tests' job
(tests/kernels/gemm/test_gguf_linear.py); here each result is only checked finite and near the twin's.

    python benchmarks/gguf_gemv_sweep.py [--budget SECONDS]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from gguf import GGMLQuantizationType as T  # noqa: E402

from sparrow.kernels import backend  # noqa: E402
from sparrow.kernels.gemm.gguf import GgufConfig, forced_config, gguf_linear, gguf_weight_bytes, pick_config  # noqa: E402
from gpu_timing import copy_bandwidth, time_s  # noqa: E402  (beside this script)
from tests.kernels.gemm.test_gguf_linear import MODEL_D, _qweight, _x  # noqa: E402

SHAPES = ((T.Q4_K, 4096, 4096), (T.Q4_K, 14336, 4096), (T.Q6_K, 4096, 14336), (T.Q4_K, 4096, 14336),
          (T.Q6_K, 1024, 4096), (T.Q8_0, 4096, 4096), (T.Q8_0, 14336, 4096), (T.Q5_0, 2048, 640))
"""Llama-3-8B's Q4_K_M linears (q/o, gate/up, down at Q6_K and Q4_K, v at Q6_K), its Q8_0 file's, Gemma 3 270M's Q5_0."""
# (block_n, block_k, num_warps, split_k, num_stages); split_k 0 = automatic
TILES = ((64, 128, 8, 0, 3), (64, 128, 8, 0, 1), (64, 128, 8, 1, 3), (16, 256, 4, 0, 3), (32, 256, 4, 0, 3),
         (32, 128, 4, 0, 3), (64, 128, 4, 0, 3), (128, 128, 8, 0, 3), (64, 256, 8, 0, 3), (32, 512, 8, 0, 3),
         (16, 512, 4, 0, 3), (16, 128, 2, 0, 3), (8, 256, 2, 0, 3), (128, 64, 8, 0, 3), (32, 256, 8, 0, 3),
         (16, 256, 4, 1, 3), (32, 128, 4, 1, 3))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=150.0, help="stop starting new tiles after this many seconds")
    args = p.parse_args(argv)
    t0, best = time.time(), {}
    peak = copy_bandwidth()
    print(f"copy bandwidth {peak / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    for qtype, n, k in SHAPES:
        qweight = _qweight(qtype, n, k, seed=2, device="cuda", fp16_max=MODEL_D)
        x = _x(1, k, torch.bfloat16, seed=0, device="cuda")
        with backend("torch"):
            want = gguf_linear(x, qweight, qtype).float()
        nbytes = gguf_weight_bytes(qweight)
        sec = time_s(lambda: gguf_linear(x, qweight, qtype))
        print(f"{qtype.name} {n}x{k} default {pick_config(1, torch.cuda.get_device_name(), qtype)}: "
              f"{sec * 1e6:.1f} us {nbytes / sec / 1e9:.0f} GB/s = {100 * nbytes / sec / peak:.0f} % of copy",
              flush=True)
        rows = []
        for bn, bk, warps, split, stages in TILES:
            if time.time() - t0 > args.budget:
                break
            cfg = GgufConfig(block_m=1, block_n=bn, block_k=bk, num_warps=warps, split_k=split, num_stages=stages,
                             fma=True)
            try:
                with forced_config(cfg):
                    got = gguf_linear(x, qweight, qtype).float()
                    ok = bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= (
                        1e-2 * float(want.abs().max()) + 1e-6)
                    sec = time_s(lambda: gguf_linear(x, qweight, qtype))
            except Exception as e:  # noqa: BLE001 - a tile the card cannot run is a result of the sweep
                print(f"{qtype.name} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append((sec, cfg, ok))
            print(f"{qtype.name} {n}x{k} bn={bn} bk={bk} w={warps} split={split} st={stages}: {sec * 1e6:.1f} us "
                  f"{nbytes / sec / 1e9:.0f} GB/s = {100 * nbytes / sec / peak:.0f} %{'' if ok else ' MISMATCH'}",
                  flush=True)
        rows.sort(key=lambda r: r[0])
        if rows:
            best[f"{qtype.name} {n}x{k}"] = rows[0]
    print(f"\nbest per shape ({torch.cuda.get_device_name()}):")
    for key, (sec, cfg, ok) in best.items():
        print(f"  {key}: {sec * 1e6:.1f} us {cfg}{'' if ok else ' MISMATCH'}")


if __name__ == "__main__":
    main()
