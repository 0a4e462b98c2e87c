"""GPU micro-benchmark of the paged prefill attention kernel at the Gemma 4 26B-A4B shapes: one step of
4 prompts x 2048 tokens (the bench's 8192-token step budget), sliding layers (16 q heads, 8 KV heads,
head dim 256, window 1024) and full layers (16 q heads, 2 KV heads, head dim 512, K = V).

    python benchmarks/attention_prefill.py [--seqs 4] [--len 2048]
    python benchmarks/attention_prefill.py --tune        (sweep tiles; print the best per layer kind)

Per line: layer kind, time per call (CUDA-graph replay), TFLOP/s counted over the visible (causal,
windowed) query-key pairs only (4 * D flops per pair and head: q.k and p.v), and the same for torch's
``scaled_dot_product_attention`` on contiguous [S, H, L, D] tensors (no paging; full layers causal, sliding
layers with an explicit window mask) as a reference.
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_timing import time_s  # noqa: E402  (beside this script)

PAGE = 16
KINDS = {  # name: (q heads, KV heads, head dim, window)
    "sliding": (16, 8, 256, 1024),
    "full": (16, 2, 512, None),
}



def visible_pairs(length: int, window: int | None) -> int:
    """Query-key pairs a causal (windowed) prompt of ``length`` tokens attends."""
    w = window or length
    return sum(min(i + 1, w) for i in range(length))


def make_inputs(seqs: int, length: int, hq: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, blocks = seqs * length, -(-length // PAGE)
    q = torch.randn(rows, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k_cache = torch.randn(seqs * blocks, PAGE, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn(seqs * blocks, PAGE, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    block_tables = torch.arange(seqs * blocks, device="cuda", dtype=torch.int32).view(seqs, blocks)
    seq_lens = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
    qsl = torch.arange(0, rows + 1, length, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens, qsl


def sdpa_call(seqs: int, length: int, hq: int, hkv: int, d: int, window: int | None):
    import torch.nn.functional as F

    q, k, v = (torch.randn(seqs, h, length, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    mask = None
    if window:
        i = torch.arange(length, device="cuda")
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=True, scale=d**-0.5)


def bench(seqs: int, length: int, config: dict | None = None, kinds=KINDS) -> dict:
    from sparrow.kernels.attention.attention import paged_prefill_attention

    out = {}
    for name, (hq, hkv, d, window) in kinds.items():
        args = make_inputs(seqs, length, hq, hkv, d)
        flops = 4 * d * hq * seqs * visible_pairs(length, window)
        t = time_s(lambda: paged_prefill_attention(*args, d**-0.5, window, None, config=config))
        out[name] = (t, flops / t / 1e12)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--len", type=int, default=2048, dest="length")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--block-m", nargs="+", type=int, default=[32, 64, 128], help="BLOCK_M values to tune")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS), help="layer kinds to tune")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_prefill: needs a CUDA GPU")
        return
    print(f"{torch.cuda.get_device_name()}: {a.seqs} x {a.length} tokens")
    for name, (t, tflops) in bench(a.seqs, a.length).items():
        hq, hkv, d, window = KINDS[name]
        flops = 4 * d * hq * a.seqs * visible_pairs(a.length, window)
        try:
            ts = time_s(sdpa_call(a.seqs, a.length, hq, hkv, d, window))
            ref = f"torch sdpa {ts * 1e3:8.3f} ms {flops / ts / 1e12:7.1f} TFLOP/s"
        except RuntimeError as e:
            ref = f"torch sdpa failed: {str(e).splitlines()[0][:80]}"
        print(f"{name:<8} D={d:<4} sparrow {t * 1e3:8.3f} ms {tflops:7.1f} TFLOP/s | {ref}", flush=True)
    if not a.tune:
        return
    for name in a.kinds:
        d = KINDS[name][2]
        results = []
        for bm, bn, bd, warps, stages in itertools.product(a.block_m, (32, 64), (64, 128),
                                                            (4, 8), (1, 2)):
            if bd > d:
                continue
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
            try:
                t, tflops = bench(a.seqs, a.length, cfg, {name: KINDS[name]})[name]
            except Exception:  # out of shared memory / registers
                continue
            results.append((t, tflops, cfg))
            print(f"  {name:<8} {t * 1e3:8.3f} ms {tflops:7.1f} TFLOP/s {cfg}", flush=True)
        results.sort(key=lambda r: r[0])
        for t, tflops, cfg in results[:4]:
            print(f"best {name:<8} D={d}: {t * 1e3:8.3f} ms {tflops:7.1f} TFLOP/s {cfg}", flush=True)


if __name__ == "__main__":
    main()
