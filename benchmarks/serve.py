"""``sparrow serve`` under N concurrent streaming clients beside the same load through ``LLM`` in-process:
output tok/s, TTFT p50 / p99 and inter-token latency (ITL) p50 / p99 at each stream count, the ratio of the
served to the in-process tok/s and the TTFT p50 the server adds.

    python benchmarks/serve.py --model-shape gemma4-26b-a4b --quantization fp8 --device cuda --out serve.json
    python benchmarks/serve.py --model-shape tiny-dense --device cpu --streams 1,2 --prompt-len 8 \\
        --max-tokens 4 --requests-per-stream 2 --min-requests 1   # a CPU smoke run (seconds)

Load: N streams, each a closed loop of --requests-per-stream requests (the next one sent when the last ended;
more at small N, so that a point has at least --min-requests);
every request is a fresh random token-id prompt of --prompt-len (no prefix-cache hits), greedy, ignore_eos,
--max-tokens new tokens. Before each point the same load with other prompts runs unmeasured on both sides, so
that each meets its kernel compiles (a step of a composition not seen before compiles kernels for seconds: a
long-running server pays that once) and allocator growth there. The served and in-process sides get the same
prompts.

Served: ``python -m sparrow serve`` in a subprocess on a free port (the engine flags below, plus
--max-num-seqs = the largest N), waited for on /health; the clients (httpx, streaming /v1/completions with
token-id prompts; the streams spread over --client-procs processes, an asyncio loop each, so that the client
keeps up: one Python loop reading 64 streams' chunks is busy most of the time) time each SSE chunk's arrival and
count its ``token_ids``; each point also prints the server's own mean TTFT, queue time and e2e latency (from
/metrics, over the point's requests) and the busiest client process's CPU share. Then the server is stopped (its GPU memory goes with the process) and the same model is built
here (``model_shapes.random_llm`` with the same seed: the same weights; or ``LLM(--model)``) with the same
engine settings; in-process, the requests go to its engine directly and a token's time is the end of the
``Engine.step`` that produced it. TTFT: request sent (added) -> its first token; ITL: the gap between a
request's consecutive chunks (steps) / the tokens they carried; tok/s: generated tokens / the point's wall
time. --out writes every number as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_RATIO, TARGET_ADDED_TTFT_MS = 0.95, 5.0
"""The server delivers >= 95 % of the in-process tok/s and adds <= 5 ms to TTFT p50 (at 1 and the most streams)."""


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); nan when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stats(wall: float, ttfts: list[float], itls: list[float], tpots: list[float], tokens: int, requests: int,
           chunks: int) -> dict:
    """ITL: per chunk after the first, its gap / its tokens (no samples when every request came in one chunk
    after its first: the server merges the steps a slow reader missed); TPOT: per request, (last token's time -
    first token's) / (tokens - 1)."""
    return {"wall_s": wall, "requests": requests, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "chunks": chunks, "ttft_p50_ms": _pct(ttfts, .5) * 1e3, "ttft_p99_ms": _pct(ttfts, .99) * 1e3,
            "itl_p50_ms": _pct(itls, .5) * 1e3, "itl_p99_ms": _pct(itls, .99) * 1e3,
            "tpot_p50_ms": _pct(tpots, .5) * 1e3}


def _prompts(seed: int, streams: int, rounds: int, prompt_len: int, vocab: int) -> list[list[list[int]]]:
    """[stream][round] -> a random token-id prompt."""
    import random

    rng = random.Random(seed)
    return [[[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(rounds)] for _ in range(streams)]


# ---------------------------------------------------------------------------------------------- served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_flags(args) -> list[str]:
    """The engine flags both sides share, as `sparrow serve` flags."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(max(args.streams)), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    flags += ["--model-shape", args.model_shape, "--seed", str(args.seed)] if args.model_shape else ["--model", args.model]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    if args.quantize_lm_head:
        flags += ["--quantize-lm-head"]
    if args.enforce_eager:
        flags += ["--enforce-eager"]
    if args.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.enable_expert_parallel:
        flags += ["--enable-expert-parallel"]
    return flags


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`python -m sparrow serve` on a free port; returns (process, base URL) once /health answers. Raises
    RuntimeError (with the log's tail) if it exits or does not answer within --startup-timeout."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "sparrow", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", *_engine_flags(args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    tail = "".join(log_path.read_text().splitlines(True)[-20:])
    raise RuntimeError(f"the server did not come up ({' '.join(cmd)}):\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful stop), then kill after 30 s."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _client_streams(url: str, prompts, max_tokens: int) -> dict:
    """Run ``prompts`` ([stream][round]) as closed-loop streams in this process's event loop; the raw samples,
    the wall interval and this process's CPU seconds over it."""
    import httpx

    raw = {"ttfts": [], "itls": [], "tpots": [], "tokens": 0, "chunks": 0}

    async def one(http, prompt):
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        first = last = None
        n = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the server answered {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                k = len(chunk["choices"][0].get("token_ids") or ()) if chunk["choices"] else 0
                if not k:
                    continue
                now = time.perf_counter()
                raw["chunks"] += 1
                if last is None:
                    raw["ttfts"].append(now - t0)
                    first = now
                else:
                    raw["itls"].append((now - last) / k)
                last, n = now, n + k
        raw["tokens"] += n
        if n > 1:
            raw["tpots"].append((last - first) / (n - 1))

    async def stream(rounds):
        # a client (one keep-alive connection) per stream: httpx's pool scans all its connections on every
        # request and read, so one shared pool of N connections costs the client O(N) per chunk
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for p in rounds:
                await one(http, p)

    cpu, t0 = time.process_time(), time.time()
    await asyncio.gather(*(stream(r) for r in prompts))
    raw.update(start=t0, end=time.time(), cpu_s=time.process_time() - cpu)
    return raw


def _client_process(url: str, prompts, max_tokens: int, go, results) -> None:
    """A client process: import httpx, wait for ``go``, run its streams, put the raw samples on ``results``."""
    import httpx  # noqa: F401  (imported before the start, not inside the timed run)

    go.wait()
    try:
        results.put(asyncio.run(_client_streams(url, prompts, max_tokens)))
    except BaseException as e:  # the parent reports it
        results.put({"error": f"{type(e).__name__}: {e}"})


def _served_point(url: str, prompts, max_tokens: int, procs: int) -> dict:
    """The streams of ``prompts`` spread over ``procs`` client processes (one asyncio loop each), started
    together; tok/s over the first start to the last end. ``client_cpu_max``: the busiest client process's CPU
    seconds / its wall time (near 1: the client, not the server, set the pace)."""
    import multiprocessing as mp

    procs = max(1, min(procs, len(prompts)))
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url, prompts[i::procs], max_tokens, go, results))
               for i in range(procs)]
    for w in workers:
        w.start()
    time.sleep(1.0)  # the workers import httpx
    go.set()
    raws = [results.get() for _ in workers]
    for w in workers:
        w.join()
    errors = [r["error"] for r in raws if "error" in r]
    if errors:
        raise RuntimeError(f"a client process failed: {errors[0]}")
    wall = max(r["end"] for r in raws) - min(r["start"] for r in raws)
    out = _stats(wall, [x for r in raws for x in r["ttfts"]], [x for r in raws for x in r["itls"]],
                 [x for r in raws for x in r["tpots"]], sum(r["tokens"] for r in raws), sum(len(r) for r in prompts),
                 sum(r["chunks"] for r in raws))
    out["client_procs"] = procs
    out["client_cpu_max"] = max(r["cpu_s"] / (r["end"] - r["start"]) for r in raws)
    return out


def server_metrics(url: str) -> dict[str, float]:
    """/metrics' sums and counts of the server-side histograms (TTFT, queue time, e2e, engine steps by kind),
    keyed ``name`` or ``name:kind`` (e.g. ``sparrow:engine_step_seconds_sum:prefill``)."""
    import re

    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        if base.endswith(("_seconds_sum", "_seconds_count")) and base.startswith("sparrow:"):
            kind = re.search(r'kind="(\w+)"', name)
            key = f"{base}:{kind.group(1)}" if kind else base
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _server_means(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds of each server-side histogram over the samples between two scrapes, as
    ``server_<name>[_<kind>]_mean_ms``; engine steps also as ``server_engine_step_<kind>_count``."""
    out = {}
    for key in after:
        name, _, kind = key.partition("_seconds_sum")
        if key == name:
            continue
        count_key = f"{name}_seconds_count{kind}"
        n = after.get(count_key, 0) - before.get(count_key, 0)
        if n:
            short = name.split(":", 1)[1] + (f"_{kind[1:]}" if kind else "")
            out[f"server_{short}_mean_ms"] = (after[key] - before.get(key, 0.0)) / n * 1e3
            if kind:
                out[f"server_{short}_count"] = int(n)
    return out


# ---------------------------------------------------------------------------------------------- in-process


def build_llm(args):
    """The in-process LLM with the server's engine settings."""
    kw = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(args.streams),
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
              tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel)
    if args.model_shape:
        from sparrow.model_shapes import random_llm

        return random_llm(args.model_shape, seed=args.seed, **kw)
    from sparrow import LLM

    return LLM(args.model, skip_tokenizer_init=True, **kw)


def in_process_point(llm, prompts, max_tokens: int) -> dict:
    """The same closed loop on ``llm``'s engine: a stream's next request is added after the step that ended
    its last one."""
    from sparrow import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = [list(r) for r in prompts]
    owner, start, first, last, count = {}, {}, {}, {}, {}
    ttfts, itls, tpots, tokens, chunks = [], [], [], 0, 0

    def add(s: int) -> None:
        if pending[s]:
            rid = eng.add_request({"prompt_token_ids": pending[s].pop(0)}, params)
            owner[rid], start[rid] = s, time.perf_counter()

    t0 = time.perf_counter()
    for s in range(len(prompts)):
        add(s)
    steps = {"prefill": [0, 0.0], "decode": [0, 0.0]}
    while eng.has_unfinished_requests():
        t_step = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        kind = steps["prefill" if eng.last_step_prefill else "decode"]
        kind[0], kind[1] = kind[0] + 1, kind[1] + now - t_step
        for o in outs:
            k = len(o.outputs[0].delta_token_ids)
            rid = o.request_id
            if k:
                tokens, chunks = tokens + k, chunks + 1
                if rid not in last:
                    ttfts.append(now - start[rid])
                    first[rid], count[rid] = now, 0
                else:
                    itls.append((now - last[rid]) / k)
                last[rid] = now
                count[rid] += k
            if o.finished:
                if count.get(rid, 0) > 1:
                    tpots.append((last[rid] - first[rid]) / (count[rid] - 1))
                add(owner[rid])
    out = _stats(time.perf_counter() - t0, ttfts, itls, tpots, tokens, sum(len(r) for r in prompts), chunks)
    for kind, (n, seconds) in steps.items():
        if n:
            out[f"engine_step_{kind}_mean_ms"], out[f"engine_step_{kind}_count"] = seconds / n * 1e3, n
    return out


# ---------------------------------------------------------------------------------------------- report


def _line(side: str, n: int, r: dict) -> str:
    return (f"{side:10s} streams {n:4d}: {r['output_tok_s']:9.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.2f} ms "
            f"p99 {r['ttft_p99_ms']:8.2f} ms  ITL p50 {r['itl_p50_ms']:7.2f} ms p99 {r['itl_p99_ms']:7.2f} ms  "
            f"TPOT p50 {r['tpot_p50_ms']:7.2f} ms  {r['chunks'] / r['requests']:5.1f} chunks/request")


def _server_line(r: dict) -> str:
    means = ", ".join(f"{k[len('server_'):-len('_mean_ms')]} {v:.2f}"
                      + (f" x {r[k[:-len('_mean_ms')] + '_count']}" if k[:-len('_mean_ms')] + "_count" in r else "")
                      for k, v in sorted(r.items()) if k.startswith("server_") and k.endswith("_mean_ms"))
    return (f"{'':10s} server-side means (ms): {means or 'none'}; {r['client_procs']} client processes, "
            f"busiest at {r['client_cpu_max']:.0%} CPU")


def _compare(points: list[dict], target_streams: tuple[int, ...]) -> None:
    for p in points:
        s, i = p["served"], p["in_process"]
        p["ratio_tok_s"] = s["output_tok_s"] / i["output_tok_s"]
        p["added_ttft_p50_ms"] = s["ttft_p50_ms"] - i["ttft_p50_ms"]
        if p["streams"] in target_streams:
            p["meets_target"] = p["ratio_tok_s"] >= TARGET_RATIO and p["added_ttft_p50_ms"] <= TARGET_ADDED_TTFT_MS


def _meta(args) -> dict:
    meta = {k: v for k, v in vars(args).items()}
    meta.update(python=platform.python_version(), load_average_start=os.getloadavg())
    return meta


def _device_meta(meta: dict, llm) -> None:
    """torch's version and the device's name (read after the server ran: this process touches CUDA only then)."""
    import torch

    meta.update(torch=torch.__version__, engine_device=llm.config.device, engine_dtype=llm.config.dtype,
                kv_cache_tokens=llm.engine.block_manager.num_blocks * llm.config.cache.block_size)
    if llm.config.device.startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name()
    else:
        meta["device_name"] = platform.processor() or platform.machine()


def _int_list(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-shape", default=None, help="a random-weight named shape (sparrow/model_shapes.py)")
    src.add_argument("--model", default=None, help="a checkpoint (its tokenizer is not needed)")
    ap.add_argument("--streams", type=_int_list, default=[1, 8, 64], help="concurrent streams per point (1,8,64)")
    ap.add_argument("--requests-per-stream", type=int, default=4, help="requests each stream sends in turn (4)")
    ap.add_argument("--min-requests", type=int, default=16,
                    help="at least this many requests per point: a stream sends more at small N (16)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (128)")
    ap.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request (128)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: prompt-len + max-tokens + 1")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks of both sides, one GPU each (1; sparrow spawns ranks 1..N-1)")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="MoE experts split over the ranks")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes the streams are spread over (default: one per 16 streams)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (0)")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for /health (900)")
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    args = ap.parse_args(argv)
    args.max_model_len = args.max_model_len or args.prompt_len + args.max_tokens + 1
    if args.model_shape:
        from sparrow.model_shapes import shape_config

        vocab = shape_config(args.model_shape)["vocab_size"]
    else:
        from sparrow.loader.model_loader import read_model_config

        vocab = read_model_config(args.model)[0].vocab_size
    rounds = {n: max(args.requests_per_stream, -(-args.min_requests // n)) for n in args.streams}
    loads = {n: (_prompts(args.seed + 1000 + n, n, rounds[n], args.prompt_len, vocab),
                 _prompts(args.seed + n, n, rounds[n], args.prompt_len, vocab)) for n in args.streams}
    report = {"meta": _meta(args), "points": [{"streams": n} for n in args.streams]}

    log_path = Path(args.out).with_suffix(".server.log") if args.out else Path(tempfile.mkstemp(".log")[1])
    print(f"starting sparrow serve ({' '.join(_engine_flags(args))}); log {log_path}", flush=True)
    t = time.perf_counter()
    proc, url = start_server(args, log_path)
    print(f"server up in {time.perf_counter() - t:.1f} s", flush=True)
    try:
        for point in report["points"]:
            warm, load = loads[point["streams"]]
            procs = args.client_procs or -(-point["streams"] // 16)
            _served_point(url, warm, args.max_tokens, procs)
            before = server_metrics(url)
            point["served"] = _served_point(url, load, args.max_tokens, procs)
            point["served"].update(_server_means(before, server_metrics(url)))
            print(_line("served", point["streams"], point["served"]), flush=True)
            print(_server_line(point["served"]), flush=True)
    finally:
        stop_server(proc)

    t = time.perf_counter()
    llm = build_llm(args)
    print(f"in-process LLM built in {time.perf_counter() - t:.1f} s", flush=True)
    _device_meta(report["meta"], llm)
    for point in report["points"]:
        warm, load = loads[point["streams"]]
        in_process_point(llm, warm, args.max_tokens)
        point["in_process"] = r = in_process_point(llm, load, args.max_tokens)
        print(_line("in-process", point["streams"], r), flush=True)
        print(f"{'':10s} engine steps (ms): " + ", ".join(
            f"{kind} {r[f'engine_step_{kind}_mean_ms']:.2f} x {r[f'engine_step_{kind}_count']}"
            for kind in ("prefill", "decode") if f"engine_step_{kind}_count" in r), flush=True)

    _compare(report["points"], (1, max(args.streams)))
    print(f"\nstreams  served/in-process tok/s  added TTFT p50 ms   (target: >= {TARGET_RATIO:.0%}, "
          f"<= {TARGET_ADDED_TTFT_MS:.0f} ms at 1 and {max(args.streams)} streams)")
    for p in report["points"]:
        verdict = {True: "  meets target", False: "  MISSES target"}.get(p.get("meets_target"), "")
        print(f"{p['streams']:7d}  {p['ratio_tok_s']:23.1%}  {p['added_ttft_p50_ms']:16.2f}{verdict}")
    report["meta"]["load_average_end"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
