"""GPU micro-benchmark of one MoE layer (router output -> experts -> weighted reduce) at the Gemma 4 26B-A4B
shape: H = 2816, E = 128, K = 8, I = 704 (or another MoE shape of ``sparrow bench``: ``--shape``), bf16,
FP8 (e4m3, 128 x 128 block scales, W8A8), int4 (W4A16, symmetric, group 128, bf16 scales) and NVFP4 (W4A16,
ModelOpt's formula, one global scale per projection).

    python benchmarks/moe_layer.py [--rows 1 8 64 1024] [--dtypes bf16 fp8 int4 nvfp4] [--out result.json] [--torch]
    python benchmarks/moe_layer.py --rows 1 8 --dtypes fp8 int4 nvfp4    (the 4-bit experts beside FP8)
    python benchmarks/moe_layer.py --rows 1024 8192 --dtypes fp8 int4 nvfp4 --w4-dequant   (kernel vs dequantize)
    python benchmarks/moe_layer.py --shape qwen3-30b-a3b      (H 2048, E 128, K 8, I 768: its own config file)
    python benchmarks/moe_layer.py --tune [--rows ...]     (sweep tiles, write sparrow/kernels/configs/*.json)
    python benchmarks/moe_layer.py --tune --quick --rows 2048 8192 --dtypes fp8   (prefill sizes: a short list)

Per line: rows, path (small / grouped), time per call (CUDA-graph replay of ``fused_moe_triton``; each
captured call uses the next of 16 routings, so the experts' weights come from HBM, not L2), the bytes
bound (weights of the distinct experts the routings touch, mean over the routings, plus x, topk and the
output; at the copy bandwidth measured at the start of the run), the achieved GB/s, % of copy bandwidth,
time / bound and TFLOP/s (2 x pairs x 3 x I x H: the measure at prefill sizes, where the GEMMs are
compute-bound). Shapes: R = rows, P = R * K pairs. ``--torch`` adds the torch reference path
(sparrow.layers.moe, not graph-capturable: host-synced) for comparison.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_timing import compile_share, copy_bandwidth, sweep_shard, time_s  # noqa: E402  (beside this script)

H, E, K, I = 2816, 128, 8, 704
N_ROUTINGS = 16


def set_shape(name: str) -> None:
    """H, E, K, I from the MoE model shape ``name`` of sparrow.model_shapes (SystemExit for a dense or unknown one)."""
    global H, E, K, I
    from sparrow.model_shapes import SHAPES

    cfg = SHAPES.get(name)
    if cfg is None or "num_experts" not in cfg:
        moe = [n for n, c in SHAPES.items() if "num_experts" in c]
        raise SystemExit(f"--shape {name!r}: not an MoE model shape; MoE shapes: {', '.join(moe)}")
    H, E, I = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    K = cfg.get("num_experts_per_tok") or cfg["top_k_experts"]


def _fp8_kind(dtype: str) -> tuple[bool, str | None]:
    """(FP8 weights, the config-file kind of moe_configs: None for bf16 / fp8, else "int4" / "nvfp4")."""
    return dtype == "fp8", (dtype if dtype in ("int4", "nvfp4") else None)


def make_layer(dtype: str, seed: int = 0):
    """The experts' keyword arguments of the dtype's launcher (``_launchers``)."""
    from sparrow.kernels.gemm.fp8 import quantize_fp8_block_ref

    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(torch.bfloat16)
    if dtype == "bf16":
        return dict(gate_up_proj=w13, down_proj=w2)
    if dtype == "int4":
        from sparrow.kernels.gemm.int4 import quantize_int4_ref

        (p13, s13, _), (p2, s2, _) = (quantize_int4_ref(w, 128, True, torch.bfloat16) for w in (w13, w2))
        return dict(w13=p13, w13_scale=s13, w13_zero=None, w2=p2, w2_scale=s2, w2_zero=None, group=128)
    if dtype == "nvfp4":
        from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref

        out = {}
        for name, w, blocks in (("w13", w13, 2), ("w2", w2, 1)):
            rows = w.shape[1] // blocks
            parts = [[quantize_nvfp4_ref(we[b * rows:(b + 1) * rows]) for b in range(blocks)] for we in w]
            out[name] = torch.stack([torch.cat([q for q, _, _ in ps]) for ps in parts])
            out[f"{name}_scale"] = torch.stack([torch.cat([s for _, s, _ in ps]) for ps in parts])
            out[f"{name}_global"] = torch.stack([torch.stack([g2 for _, _, g2 in ps]) for ps in parts])
        return out
    out = {}
    for name, w, sname in (("gate_up_proj", w13, "w13_scale"), ("down_proj", w2, "w2_scale")):
        qs = [quantize_fp8_block_ref(we) for we in w]
        out[name] = torch.stack([q for q, _ in qs])
        out[sname] = torch.stack([s for _, s in qs])
        del qs
    return out


def make_routings(rows: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    routings = []
    for _ in range(N_ROUTINGS):
        logits = torch.randn(rows, E, device="cuda", generator=g)
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        routings.append((w, ids.to(torch.int32)))
    return routings


def _launchers(dtype: str):
    """(Triton launcher, torch twin) of the dtype's experts, both called with make_layer's keywords."""
    if dtype == "int4":
        from sparrow.kernels.moe.int4_moe import int4_fused_moe_ref, int4_fused_moe_triton

        return int4_fused_moe_triton, int4_fused_moe_ref
    if dtype == "nvfp4":
        from sparrow.kernels.moe.nvfp4_moe import nvfp4_fused_moe_ref, nvfp4_fused_moe_triton

        return nvfp4_fused_moe_triton, nvfp4_fused_moe_ref
    from sparrow.kernels.moe.moe import fused_moe_ref, fused_moe_triton

    return fused_moe_triton, fused_moe_ref


def bytes_bound(rows: int, dtype: str, routings) -> float:
    """Bytes a call must move: the distinct experts' weights (mean over routings) + x + routing + out."""
    per_expert = {"bf16": 2 * 3 * I * H, "fp8": 3 * I * H, "int4": 3 * I * H // 2 + 2 * 3 * I * H // 128,
                  "nvfp4": 3 * I * H // 2 + 3 * I * H // 16}[dtype]
    if dtype == "fp8":
        per_expert += 4 * (-(-2 * I // 128) * -(-H // 128) + -(-H // 128) * -(-I // 128))
    experts = sum(len(torch.unique(ids)) for _, ids in routings) / len(routings)
    return experts * per_expert + rows * H * 2 * 2 + rows * K * 8


def make_call(rows: int, layer, dtype: str = "bf16"):
    """(x [rows, H] bf16, the routings, call): each ``call()`` runs the dtype's launcher (``fused_moe_triton``,
    ``int4_fused_moe_triton``, ``nvfp4_fused_moe_triton``) on the next of the N_ROUTINGS routings, so a captured
    sequence of calls reads the experts from HBM, not L2."""
    fused_moe_triton = _launchers(dtype)[0]

    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    routings = make_routings(rows)
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % N_ROUTINGS
        w, ids = routings[state["i"]]
        return fused_moe_triton(x, topk_weights=w, topk_ids=ids, **layer)

    return x, routings, call


def bench_one(rows: int, dtype: str, layer, peak: float, with_torch: bool = False) -> dict:
    fused_moe_ref = _launchers(dtype)[1]
    x, routings, call = make_call(rows, layer, dtype)
    call()  # compile outside the capture
    t = time_s(call)
    nbytes = bytes_bound(rows, dtype, routings)
    res = dict(rows=rows, dtype=dtype, path="small" if rows * K <= 64 else "grouped",
               us=t * 1e6, bound_us=nbytes / peak * 1e6, gbps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / peak,
               tflops=2 * rows * K * 3 * I * H / t / 1e12)  # the experts' multiply-adds, x 2
    if with_torch:
        import triton.testing

        w, ids = routings[0]
        res["torch_us"] = triton.testing.do_bench(lambda: fused_moe_ref(x, topk_weights=w, topk_ids=ids, **layer),
                                                  rep=100) * 1e3
    return res


def fma_tiles(rows: int, kind: str) -> list:
    """The 4-bit small path's FMA tiles (``Tile.fma_rows``): (BLOCK_N, warps) x BLOCK_K (int4: 128, one group of
    make_layer's; NVFP4 also 256) x split-K (0: automatic), one pair at a time (and two above one row)."""
    from sparrow.kernels.moe.moe_configs import Tile

    ks = (128,) if kind == "int4" else (128, 256)
    return [Tile(n, k, w, 3, split, fma_rows=fr)
            for (n, w), k, split, fr in itertools.product(((32, 4), (64, 4), (128, 4)), ks, (0, 1, 2, 4),
                                                          (1,) if rows == 1 else (1, 2))]


def tune(rows_list, dtype: str, layer, out_dir: pathlib.Path, verbose: bool = False,
         swapped_only: bool = False, warps_stages_only: bool = False, fma_only: bool = False) -> pathlib.Path:
    """Coordinate search per rows, from the data file's entry for those rows (else the default): BLOCK_M (on the
    grouped path also paired with each swapped tile, and for FP8 with the pre-quantized-activation tiles), then
    the gate|up tile, then the down tile (45 tiles each on the small path, 18 with ``swapped_only``; 24 grouped,
    32 FP8 grouped (16 and the same with ``a_fp8``), 6 / 8 with ``swapped_only``), then each GEMM's num_warps x
    num_stages (12 each; ``warps_stages_only``: only this last step, from the current entry). The 4-bit kernels
    (int4, nvfp4): 24 small-path tiles (16 swapped; K steps 128 / 256) and ``fma_tiles`` (``fma_only``: those
    alone, without the warps x stages step), 12 grouped (4 swapped). Under ``SWEEP_SHARD`` it compiles its share of
    the tiles (as both GEMMs) and writes nothing. Writes the data file ``pick_config`` reads for this shape and
    device."""
    fp8, kind = _fp8_kind(dtype)
    from sparrow.kernels.moe import moe_configs
    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config

    table, path = {}, None
    for rows in rows_list:
        _, _, call = make_call(rows, layer, dtype)
        small = rows * K <= 64
        old = moe_configs.tuned_configs(E, H, I, fp8, torch.cuda.get_device_name(), kind)
        best = old.get(rows) or moe_configs.pick_config(rows, K, E, H, I, small, fp8, None, kind)  # the search starts here
        ms = (16,) if small else (16, 32, 64, 128)
        if small:  # 45 tiles per GEMM: K split over programs (reduced in the kernel), FP8 up to 1024-wide K steps
            ks = (256, 512, 1024) if fp8 else (128, 256, 512)
            tiles = [Tile(n, k, 4, 3, split) for n, k, split in itertools.product((16, 32, 64), ks, (1, 2, 4))]
            # swapped dots: the weight tile as the wgmma's M side (64 / 128 rows)
            swapped = [Tile(n, k, 4, 3, split, swap_ab=True) for n, k, split in itertools.product((64, 128), ks, (1, 2, 4))]
            tiles = swapped if swapped_only else tiles + swapped
            if kind:  # the 4-bit kernels: K steps of 128 or more (a group of 128 per dot), split-K 0 = automatic
                tiles = [Tile(n, k, 4, 3, split, swap_ab=True)
                         for n, k, split in itertools.product((64, 128), (128, 256), (0, 1, 2, 4))]
                tiles += [Tile(n, k, 4, 3, split) for n, k, split in itertools.product((32, 64), (128, 256), (0, 1))]
                tiles = fma_tiles(rows, kind) if fma_only else tiles + fma_tiles(rows, kind)
                swapped = []
        else:  # 24 tiles per GEMM (16 for FP8), the last 6 (4) with swapped dots
            ks = (128,) if fp8 else (32, 64, 128)
            stages = (3, 4) if fp8 else (3,)
            tiles = [Tile(n, k, w, s) for n, k, w, s in itertools.product((32, 64, 128), ks, (4, 8), stages)]
            swapped = [Tile(n, k, 4, s, swap_ab=True) for n, k, s in itertools.product((64, 128), ks, stages)]
            tiles = swapped if swapped_only else tiles + swapped
            if fp8:  # each also with its activations quantized by a launch of their own (Tile.a_fp8)
                tiles += [dataclasses.replace(t, a_fp8=True) for t in tiles]
            if kind:
                tiles = [Tile(n, k, w, 3) for n, k, w in itertools.product((64, 128), (64, 128), (4, 8))]
                swapped = [Tile(n, k, 4, 3, swap_ab=True) for n, k in itertools.product((64, 128), (64, 128))]
                tiles += swapped

        if sweep_shard():
            def once(tile):
                with forced_config(MoeConfig(best.block_m, tile, tile)):
                    call()
            compile_share(tiles, once)
            continue

        def timed(cfg):
            try:
                with forced_config(cfg):
                    t = time_s(call, rep=20)
            except Exception as exc:  # out of shared memory / registers for this tile
                print(f"  skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
                return float("inf")
            if verbose:
                print(f"  {t * 1e6:8.2f} us  {cfg}", flush=True)
            return t

        best_t = timed(best)
        # BLOCK_M with the current tiles (and on the grouped path with each swapped tile on both GEMMs: the rows
        # are the wgmma's N side there, so BLOCK_M and the swap interact), then the gate|up tile, then the down tile
        starts = [(best.gate_up, best.down)] + ([] if small else [(t, t) for t in swapped])
        if fp8 and not small:  # prefill sizes: the pre-quantized activations with swapped and wide plain tiles
            starts += [(t, t) for t in [dataclasses.replace(t, a_fp8=True) for t in swapped]
                       + [Tile(128, 128, w, 3, a_fp8=True) for w in (4, 8)]]
        if warps_stages_only:
            starts, tiles = [], []
        for bm, (gate_up, down) in itertools.product(ms if starts else (), starts):
            cand = MoeConfig(bm, gate_up, down)
            t = timed(cand)
            if t < best_t:
                best, best_t = cand, t
        for which in ("gate_up", "down"):
            for tile in tiles:
                cand = MoeConfig(best.block_m, tile if which == "gate_up" else best.gate_up,
                                 tile if which == "down" else best.down)
                t = timed(cand)
                if t < best_t:
                    best, best_t = cand, t
        for which in ("gate_up", "down") if not fma_only else ():
            for nw, ns in itertools.product((2, 4, 8), (2, 3, 4, 5)):
                tile = dataclasses.replace(getattr(best, which), num_warps=nw, num_stages=ns)
                cand = dataclasses.replace(best, **{which: tile})
                if cand != best:
                    t = timed(cand)
                    if t < best_t:
                        best, best_t = cand, t
        print(f"rows {rows:5d} {dtype}: {best_t * 1e6:8.2f} us  {best}", flush=True)
        table[str(rows)] = best.to_json()
        # after each row count, so a run cut short keeps what it tuned
        path = write_table(table, dtype, out_dir, torch.cuda.get_device_name(), torch.__version__)
    return path


def prefill_candidates(fp8: bool):
    """The short list ``--quick`` times at prefill sizes (grouped path): wide plain tiles for the compute-bound
    GEMMs and the swapped ones the coordinate search chose at 1,024 / 4,096 rows; for FP8 each with and
    without ``a_fp8``."""
    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile

    k = 128 if fp8 else 64
    base = [MoeConfig(32, Tile(64, k, 4, 3, swap_ab=True), Tile(128, k, 4, 3, swap_ab=True)),
            MoeConfig(64, Tile(128, k, 4, 3, swap_ab=True), Tile(128, k, 4, 3, swap_ab=True)),
            MoeConfig(64, Tile(128, k, 4, 3), Tile(128, k, 4, 3)),
            MoeConfig(128, Tile(128, k, 8, 3), Tile(128, k, 8, 3)),
            MoeConfig(128, Tile(64, k, 4, 3), Tile(128, k, 8, 3))]
    if not fp8:
        return base
    return base + [MoeConfig(c.block_m, dataclasses.replace(c.gate_up, a_fp8=True),
                             dataclasses.replace(c.down, a_fp8=True)) for c in base]


def tune_quick(rows_list, dtype: str, layer, out_dir: pathlib.Path) -> pathlib.Path:
    """Time the table's current entry and ``prefill_candidates`` at each row count (a few compiles instead of
    the coordinate search's hundred: minutes on a fresh machine) and write the fastest into the data file."""
    from sparrow.kernels.moe import moe_configs
    from sparrow.kernels.moe.moe_configs import forced_config

    fp8, kind = _fp8_kind(dtype)
    if kind:
        raise SystemExit(f"--quick: FP8 / bf16 tiles only; tune {dtype} without it")
    table = {}
    for rows in rows_list:
        if rows * K <= 64:
            print(f"rows {rows}: the small path; --quick times grouped-path tiles only (use --tune without it)")
            continue
        _, _, call = make_call(rows, layer, dtype)
        current = moe_configs.pick_config(rows, K, E, H, I, False, fp8, torch.cuda.get_device_name())
        best, best_t = None, float("inf")
        for cfg in [current] + prefill_candidates(fp8):
            try:
                with forced_config(cfg):
                    t = time_s(call, rep=20)
            except Exception as exc:  # out of shared memory / registers for this tile
                print(f"  skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
                continue
            print(f"  {t * 1e6:9.1f} us {2 * rows * K * 3 * I * H / t / 1e12:6.1f} TFLOP/s  {cfg}", flush=True)
            if t < best_t:
                best, best_t = cfg, t
        if best is None:
            print(f"rows {rows}: no candidate ran")
            continue
        print(f"rows {rows:5d} {dtype}: {best_t * 1e6:8.2f} us  {best}", flush=True)
        table[str(rows)] = best.to_json()
        write_table(table, dtype, out_dir, torch.cuda.get_device_name(), torch.__version__)
    return out_dir / moe_configs.config_file(E, H, I, fp8, torch.cuda.get_device_name()).name


def write_table(table: dict, dtype: str, out_dir: pathlib.Path, device_name: str, torch_version: str) -> pathlib.Path:
    """Write (or rewrite) the data file ``pick_config`` reads for this shape, expert dtype and device. Entries of
    the existing file for row counts not in ``table`` are kept; meta ``tuned_rows`` lists the entries a sweep chose."""
    from sparrow.kernels.moe import moe_configs

    fp8, kind = _fp8_kind(dtype)
    path = out_dir / moe_configs.config_file(E, H, I, fp8, device_name, kind).name
    old = json.loads(path.read_text()) if path.exists() else {}
    configs = {**old.get("configs", {}), **table}
    tuned = sorted({*old.get("meta", {}).get("tuned_rows", []), *map(int, table)})
    meta = {"device": device_name, "torch": torch_version, "tuned_rows": tuned,
            "source": "benchmarks/moe_layer.py --tune (rows not in tuned_rows: the entries this file had before)"}
    configs = dict(sorted(configs.items(), key=lambda kv: int(kv[0])))
    path.write_text(json.dumps({"meta": meta, "configs": configs}, indent=1) + "\n")
    moe_configs._load.cache_clear()
    return path


def _print_row(r: dict, with_torch: bool) -> None:
    print(f"{r['rows']:5d} {r['dtype']:>5} {r['path']:>8} {r['us']:9.2f} {r['bound_us']:9.2f} "
          f"{r['gbps']:8.1f} {r['pct_copy']:6.1f}% {r['us'] / r['bound_us']:7.2f} {r['tflops']:7.1f}"
          + (f" {r['torch_us']:9.1f}" if with_torch else ""), flush=True)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 1024])
    p.add_argument("--shape", default="gemma4-26b-a4b", help="MoE model shape (sparrow bench's --model-shape names)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "int4", "nvfp4"])
    p.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    p.add_argument("--torch", action="store_true", help="also time the torch reference path")
    p.add_argument("--tune", action="store_true", help="sweep tiles and write the config data files")
    p.add_argument("--verbose", action="store_true", help="with --tune: print every candidate's time")
    p.add_argument("--swapped-only", action="store_true",
                   help="with --tune: try only the swapped-dot tiles against the current entry")
    p.add_argument("--fma-only", action="store_true",
                   help="with --tune, 4-bit small path: only the FMA tiles against the current entry")
    p.add_argument("--warps-stages", action="store_true",
                   help="with --tune: only each GEMM's num_warps x num_stages, from the current entry")
    p.add_argument("--w4-dequant", action="store_true",
                   help="int4 / nvfp4 on the grouped path: also time every expert dequantized then the float kernels "
                        "(int4_moe.DEQUANT_MIN_ROWS = 0), path 'dequant'")
    p.add_argument("--quick", action="store_true",
                   help="with --tune: time only the current entry and the prefill candidates (grouped path)")
    args = p.parse_args(argv)
    set_shape(args.shape)
    if not torch.cuda.is_available():
        raise SystemExit("moe_layer.py needs a CUDA GPU")
    from sparrow.kernels.moe.moe_configs import CONFIG_DIR

    if sweep_shard():  # compiling only: 16 experts keep each process small (the same kernel variants as E)
        global E
        E = min(E, 16)
    peak = copy_bandwidth(1 << 24 if sweep_shard() else 1 << 31)
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {peak / 1e9:.0f} GB/s; "
          f"MoE layer H={H} E={E} K={K} I={I}")
    results = []
    for dtype in args.dtypes:
        layer = make_layer(dtype)
        if args.tune and args.quick:
            print("wrote", tune_quick(args.rows, dtype, layer, CONFIG_DIR))
        elif args.tune:
            path = tune(args.rows, dtype, layer, CONFIG_DIR, args.verbose, args.swapped_only, args.warps_stages,
                        args.fma_only)
            if sweep_shard():
                continue
            print("wrote", path)
        print(f"{'rows':>5} {'dtype':>5} {'path':>8} {'us':>9} {'bound us':>9} {'GB/s':>8} {'% copy':>7} "
              f"{'x bound':>7} {'TFLOP/s':>7}" + (f" {'torch us':>9}" if args.torch else ""))
        for rows in args.rows:
            r = bench_one(rows, dtype, layer, peak, args.torch)
            results.append(r)
            _print_row(r, args.torch)
            if args.w4_dequant and dtype in ("int4", "nvfp4") and rows * K > 64:
                from sparrow.kernels.moe import int4_moe

                shipped, int4_moe.DEQUANT_MIN_ROWS = int4_moe.DEQUANT_MIN_ROWS, 0
                r = dict(bench_one(rows, dtype, layer, peak, args.torch), path="dequant")
                int4_moe.DEQUANT_MIN_ROWS = shipped
                results.append(r)
                _print_row(r, args.torch)
        del layer
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": peak / 1e9,
                                        "shape": dict(H=H, E=E, K=K, I=I), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
