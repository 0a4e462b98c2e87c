"""Tile sweep of the GGUF routed experts on a CUDA card (``moe_configs.forced_config``): for gemma4-26b-a4b's and
qwen3-30b-a3b's Q4_K_M expert shapes (tests/kernels/moe/test_gguf_moe.py GPU_SHAPES) at 1 and 8 rows, the default
tile's (``gguf_moe.default_gguf_config``) and each candidate tile's time per call replayed from a CUDA graph and
GB/s of the used experts' blocks against the copy bandwidth measured here, best first. Correctness is the tests'
job; here each result is only checked finite and near the twin's.

    python benchmarks/gguf_moe_sweep.py [--budget SECONDS] [--rows 1 8]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from gpu_timing import copy_bandwidth, time_s  # noqa: E402  (beside this script)

from sparrow.kernels import backend  # noqa: E402
from sparrow.kernels.moe.gguf_moe import gguf_fused_moe  # noqa: E402
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config  # noqa: E402
from tests.kernels.moe.test_gguf_moe import GPU_SHAPES, _routing, _weights  # noqa: E402

# (block_n, block_k, num_warps, split_k, fma_rows or 0 for swapped dots); the same tile for gate|up and down
FMA_TILES = ((32, 64, 8, 0), (16, 64, 4, 0), (16, 128, 4, 0), (32, 128, 8, 0), (16, 256, 4, 0), (32, 64, 4, 0),
             (64, 64, 8, 0), (16, 64, 2, 0), (16, 128, 2, 0), (32, 256, 8, 0), (16, 64, 4, 1), (32, 64, 8, 1))
DOT_TILES = ((64, 32, 8, 0), (64, 64, 8, 0), (64, 64, 4, 0), (128, 32, 8, 0), (64, 128, 8, 0), (64, 32, 4, 0),
             (64, 32, 8, 1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=150.0, help="stop starting new tiles after this many seconds")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = p.parse_args(argv)
    t0 = time.time()
    peak = copy_bandwidth()
    print(f"copy bandwidth {peak / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    for model, (experts, top_k, hidden, width, t13, t2) in sorted(GPU_SHAPES.items()):
        w13, w2 = _weights(t13, t2, experts, hidden, width, "cuda")
        for rows in args.rows:
            x, wts, ids = _routing(rows, experts, top_k, hidden, torch.bfloat16, seed=rows, device="cuda")
            used = int(torch.unique(ids).numel())
            nbytes = used * (w13[0].numel() + w2[0].numel())
            with backend("torch"):
                want = gguf_fused_moe(x.float(), w13, t13, w2, t2, wts, ids, "silu")

            def timed(label):
                got = gguf_fused_moe(x, w13, t13, w2, t2, wts, ids, "silu").float()
                ok = bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= (
                    2e-2 * float(want.abs().max()) + 1e-6)
                sec = time_s(lambda: gguf_fused_moe(x, w13, t13, w2, t2, wts, ids, "silu"))
                print(f"{model} R={rows} {label}: {sec * 1e6:.1f} us {nbytes / sec / 1e9:.0f} GB/s = "
                      f"{100 * nbytes / sec / peak:.1f} %{'' if ok else ' MISMATCH'}", flush=True)
                return sec

            timed("default")
            results = []
            fma = rows <= 4
            for bn, bk, warps, split in FMA_TILES if fma else DOT_TILES:
                if time.time() - t0 > args.budget:
                    break
                tile = Tile(block_n=bn, block_k=bk, num_warps=warps, num_stages=2, split_k=split,
                            fma_rows=rows if fma else 0, swap_ab=not fma)
                try:
                    with forced_config(MoeConfig(16, tile, tile)):
                        results.append((timed(f"bn={bn} bk={bk} w={warps} split={split}"), tile))
                except Exception as e:  # noqa: BLE001 - a tile the card cannot run is a result of the sweep
                    print(f"{model} R={rows} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            if results:
                sec, tile = min(results, key=lambda r: r[0])
                print(f"best {model} R={rows}: {sec * 1e6:.1f} us {tile}", flush=True)


if __name__ == "__main__":
    main()
