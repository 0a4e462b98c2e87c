"""Ahead-of-time sm_90 report of the 4-bit GEMV kernels, on a machine without a GPU: each variant compiled for
Hopper (Triton's own ptxas, cuobjdump from the triton package), then its registers, spill stores and the SASS of
its main K loop (the backward branch whose body loads the most global words) counted per weight element.

    python benchmarks/sass_report.py                 (dense 4096 x 2816 at R = 1, and one gemma4 MoE layer at
                                                      one row: the shipped tiles beside the FMA tiles)
    python benchmarks/sass_report.py --dump DIR      (also write each variant's SASS into DIR)
    python benchmarks/sass_report.py --smoke         (two small dense variants: the tool's own check)

The device machine compiles with its own Triton (3.6 on the H200 image); to count what it runs, put that version
first on the path: ``pip install --no-deps --target /tmp/t36 triton==3.6.0`` then ``PYTHONPATH=/tmp/t36 python
benchmarks/sass_report.py``.

A variant's launch arguments come from the real launcher (``int4.w4_linear_launch``, ``int4_moe.w4_fused_moe_
triton``) run on CPU tensors with the kernel replaced by a recorder, so the constexprs, tiles and argument types
are the ones the GPU would get (pointers taken 16-byte aligned, ints specialized as Triton's JIT does: 1 as a
constant, multiples of 16 marked divisible, declared constexprs as constants). Columns: registers, stack
bytes and local-memory stores (spills), then the main loop's SASS instructions, the weight elements a thread
handles per iteration and their ratio, and the loop's most frequent opcodes. The ratio is the issue cost that must
hide under the weight bytes' time: an H200 issues ~1.05e12 warp instructions/s (132 SMs x 4 schedulers x ~1.98
GHz), i.e. ~3.3e13 thread instructions/s, while 4.2 TB/s brings ~8.4e12 4-bit elements/s, so a kernel at its
bytes bound may spend about 4 instructions per weight element.
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv", torch.int64: "*i64"}


class Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def compile_sm90(fn, args, kw):
    """(cubin bytes, PTX-level metadata) of the JIT function ``fn`` for the recorded ``args`` / ``kw``, sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    kw.pop("launch_pdl", None)
    names = fn.arg_names
    signature, constexprs, attrs = {}, dict(kw), {}
    skip = set(getattr(fn, "do_not_specialize", ()) or ())
    declared = set(fn.constexprs)
    for i, (name, value) in enumerate(zip(names, args)):
        if i in declared:
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            constexprs[name] = value
        elif isinstance(value, int):
            if value == 1 and name not in skip and i not in skip:
                constexprs[name] = 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0 and name not in skip and i not in skip:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(value)}")
    for name in constexprs:
        signature[name] = "constexpr"
    signature = {n: signature[n] for n in names if n in signature}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    compiled = triton.compile(src, target=target, options=backend.parse_options(options).__dict__)
    return compiled.asm["cubin"], options


def _tool(name: str) -> str:
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(SASS text, resource usage text) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return sass, res


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def main_loop(sass: str) -> list[str]:
    """Opcodes of the innermost loop (a backward BRA's range holding no other) with the most global loads (LDG,
    LDGSTS) in its body: the steady-state K loop."""
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _LINE.finditer(sass)]
    loops = []
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    best, best_ldg = [], -1
    for lo, hi in inner:
        body = [o for a, o, _ in ins if lo <= a <= hi]
        ldg = sum(o.startswith("LDG") for o in body)
        if ldg > best_ldg:
            best, best_ldg = body, ldg
    return best


def report(label: str, fn, args, kw, elements_per_iter: int, dump: pathlib.Path | None) -> None:
    cubin, options = compile_sm90(fn, args, kw)
    sass, res = sass_of(cubin)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    loop = main_loop(sass)
    stl = sum(op.startswith("STL") for op in re.findall(r"\b(STL\S*)", sass))
    threads = 32 * options.get("num_warps", 4)
    per_thread = elements_per_iter / threads
    mix = collections.Counter(op.split(".")[0] for op in loop).most_common(8)
    print(f"{label:<58} regs {regs.group(1) if regs else '?':>3}  stack {stack.group(1) if stack else '?':>4}  "
          f"STL {stl:3d}  loop {len(loop):5d} ins / {per_thread:6.1f} el = {len(loop) / max(per_thread, 1e-9):5.2f}"
          f"  {' '.join(f'{o}:{c}' for o, c in mix)}", flush=True)
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / (re.sub(r"[^A-Za-z0-9_.-]+", "_", label) + ".sass")).write_text(sass)


def dense_variants(fmt: str, rows: int, n: int, k: int, configs, dump) -> None:
    from sparrow.kernels.gemm import _int4_jit, int4
    from sparrow.kernels.gemm.int4 import forced_config, quantize_int4_ref
    from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref

    w = torch.randn(n, k) / k ** 0.5
    x = torch.randn(rows, k).bfloat16()
    if fmt == "int4":
        packed, scale, zero = quantize_int4_ref(w, 128, True, torch.bfloat16)
        launch = lambda: int4.w4_linear_launch(x, packed, scale, zero, None, 128)  # noqa: E731
    else:
        codes, scale, g2 = quantize_nvfp4_ref(w)
        launch = lambda: int4.w4_linear_launch(x, codes.view(torch.int32), scale, None,  # noqa: E731
                                              g2.expand(n).contiguous(), 16)
    real = _int4_jit.w4_matmul_kernel
    for cfg in configs:
        rec = _int4_jit.w4_matmul_kernel = Recorder(real)
        try:
            with forced_config(cfg):
                launch()
        finally:
            _int4_jit.w4_matmul_kernel = real
        grid, args, kw = rec.calls[0]
        elems = kw["BLOCK_N"] * kw["BLOCK_K"]
        report(f"dense {fmt} R={rows} {n}x{k} {_short(cfg)}", real, args, kw, elems, dump)


def moe_variants(fmt: str, rows: int, tiles, dump) -> None:
    from sparrow.kernels.moe import _w4_moe_jit, int4_moe
    from sparrow.kernels.gemm.int4 import quantize_int4_ref
    from sparrow.kernels.moe.moe_configs import MoeConfig, forced_config
    from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref

    e, h, i, top_k = 4, 2816, 704, 2  # fewer experts than gemma4's 128: the same kernel variants
    x = torch.randn(rows, h).bfloat16()
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(rows)]).int()
    wts = torch.softmax(torch.randn(rows, top_k), -1)
    if fmt == "int4":
        p13, s13, _ = quantize_int4_ref(torch.randn(e, 2 * i, h) / h ** 0.5, 128, True, torch.bfloat16)
        p2, s2, _ = quantize_int4_ref(torch.randn(e, h, i) / i ** 0.5, 128, True, torch.bfloat16)
        ops = (p13, s13, None, None, p2, s2, None, None, 128)
    else:
        c13, s13, _ = quantize_nvfp4_ref(torch.randn(e * 2 * i, h) / h ** 0.5)
        c2, s2, _ = quantize_nvfp4_ref(torch.randn(e * h, i) / i ** 0.5)
        ops = (c13.view(torch.int32).reshape(e, 2 * i, -1), s13.reshape(e, 2 * i, -1), None, torch.ones(e, 2),
               c2.view(torch.int32).reshape(e, h, -1), s2.reshape(e, h, -1), None, torch.ones(e, 1), 16)
    real = _w4_moe_jit.w4_moe_gemv_kernel
    for tile in tiles:
        rec = _w4_moe_jit.w4_moe_gemv_kernel = Recorder(real)
        try:
            with forced_config(MoeConfig(16, tile, tile)):
                int4_moe.w4_fused_moe_triton(x, *ops, wts, ids, "gelu_pytorch_tanh")
        except Exception:
            pass  # the recorder returns nothing: moe_reduce has no output to read
        finally:
            _w4_moe_jit.w4_moe_gemv_kernel = real
        for (grid, args, kw), gemm in zip(rec.calls, ("gate_up", "down")):
            elems = kw["BLOCK_N"] * kw["BLOCK_K"] * (2 if kw["GATED"] else 1)
            report(f"moe {fmt} R={rows} {gemm} {_short(tile)}", real, args, kw, elems, dump)


def _short(cfg) -> str:
    d = {k: v for k, v in vars(cfg).items() if v not in (False, 0) or k in ("split_k",)}
    return " ".join(f"{k}={v}" for k, v in d.items() if k not in ("a_fp8", "scale_w") or v)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dump", type=pathlib.Path, help="write each variant's SASS into this folder")
    p.add_argument("--smoke", action="store_true", help="one small int4 FMA and one MMA variant only (seconds)")
    args = p.parse_args(argv)
    from sparrow.kernels.gemm.int4 import Int4Config, pick_config
    from sparrow.kernels.moe.moe_configs import Tile, default_w4_config

    import triton

    print(f"Triton {triton.__version__}, sm_90")
    if args.smoke:
        dense_variants("int4", 1, 256, 512, [Int4Config(1, 64, 128, split_k=1, fma=True), pick_config(1)], args.dump)
        return

    dense = [pick_config(1), Int4Config(1, 64, 128, split_k=4, fma=True),
             Int4Config(1, 128, 128, num_warps=8, split_k=4, fma=True), Int4Config(1, 128, 128, split_k=4, fma=True),
             Int4Config(1, 32, 128, split_k=4, fma=True)]
    moe = [default_w4_config(1, 8, 128, True).gate_up, Tile(64, 128, 4, 3, 0, fma_rows=1),
           Tile(32, 128, 4, 3, 0, fma_rows=1), Tile(128, 128, 4, 3, 0, fma_rows=1)]
    wide = [Int4Config(1, 64, 256, split_k=4, fma=True)], [Tile(64, 256, 4, 3, 0, fma_rows=1)]  # NVFP4 only
    for fmt in ("int4", "nvfp4"):
        dense_variants(fmt, 1, 4096, 2816, dense + (wide[0] if fmt == "nvfp4" else []), args.dump)
        moe_variants(fmt, 1, moe + (wide[1] if fmt == "nvfp4" else []), args.dump)


if __name__ == "__main__":
    main()
