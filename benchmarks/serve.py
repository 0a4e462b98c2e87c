"""``sparrow serve`` under N concurrent streaming clients beside the same load through ``LLM`` in-process:
output tok/s, TTFT p50 / p99 and inter-token latency p50 / p99 at each stream count.

    python benchmarks/serve.py [--model PATH | --tiny] [--streams 1,8,64] [--prompt-len 128] [--max-tokens 64]

Each point sends N requests at once (random token-id prompts of --prompt-len, greedy, ignore_eos, --max-tokens
new tokens each). In-process: the requests go to the LLM's engine directly and a token's time is the end of the
``Engine.step`` that produced it. Served: the same LLM behind the app in a thread of this process, the clients
(httpx, streaming /v1/completions) in a child process so they do not share the server's interpreter; a token's
time is its SSE chunk's arrival (tokens held back for an incomplete character arrive with a later chunk).
``--tiny``: a tiny random Llama with a byte tokenizer built in a temporary folder (a CPU smoke run).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(name: str, n: int, wall: float, ttfts: list[float], itls: list[float], tokens: int) -> str:
    return (f"{name:10s} streams {n:4d}: {tokens / wall:9.1f} tok/s  TTFT p50 {_pct(ttfts, .5) * 1e3:8.2f} ms "
            f"p99 {_pct(ttfts, .99) * 1e3:8.2f} ms  ITL p50 {_pct(itls, .5) * 1e3:7.2f} ms "
            f"p99 {_pct(itls, .99) * 1e3:7.2f} ms")


def in_process(llm, prompts, max_tokens: int) -> tuple[float, list[float], list[float], int]:
    from sparrow import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itls: list[float] = []
    tokens = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].delta_token_ids)
            if not n:
                continue
            tokens += n
            if o.request_id not in first:
                first[o.request_id] = now - t0
            else:
                itls.append((now - last[o.request_id]) / n)
            last[o.request_id] = now
    return time.perf_counter() - t0, [first[r] for r in rids], itls, tokens


def _client(url: str, prompts, max_tokens: int, out: mp.Queue) -> None:
    import json

    import httpx

    async def run():
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            async def one(p):
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                t0 = time.perf_counter()
                times, usage = [], 0
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            times.append(time.perf_counter() - t0)
                        if chunk.get("usage"):
                            usage = chunk["usage"]["completion_tokens"]
                return times, usage

            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(p) for p in prompts))
            return time.perf_counter() - t0, res

    wall, res = asyncio.run(run())
    ttfts = [t[0] for t, _ in res if t]
    itls = []
    for times, n in res:  # spread each gap over the tokens it carried (n tokens over len(times) chunks)
        per = max(1, n) / max(1, len(times))
        itls += [(b - a) / per for a, b in zip(times, times[1:])]
    out.put((wall, ttfts, itls, sum(n for _, n in res)))


def tiny_model() -> str:
    from tests.helpers import build_tiny_llama, save_byte_tokenizer

    path = build_tiny_llama(pathlib.Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=2048)
    save_byte_tokenizer(path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the packaged Gemma 3 270M)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama with a byte tokenizer (CPU smoke run)")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()

    import torch

    from sparrow import LLM
    from tests.server.conftest import start_server, stop_server

    streams = [int(s) for s in args.streams.split(",")]
    model = tiny_model() if args.tiny else args.model
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=max(streams),
              max_model_len=args.prompt_len + args.max_tokens + 1, enforce_eager=args.enforce_eager)
    g = torch.Generator().manual_seed(0)
    vocab = min(llm.config.model.vocab_size, len(llm.tokenizer))
    sets = {n: torch.randint(0, vocab, (n, args.prompt_len), generator=g).tolist() for n in streams}
    in_process(llm, sets[streams[0]][:1], 4)  # warm-up (graphs, kernels)
    for n in streams:
        print(_summary("in-process", n, *in_process(llm, sets[n], args.max_tokens)), flush=True)
    srv = start_server(llm)
    try:
        ctx = mp.get_context("spawn")
        for k, n in enumerate([streams[0]] + streams):  # the first point runs once more first, as a warm-up
            q = ctx.Queue()
            p = ctx.Process(target=_client, args=(srv.url, sets[n], args.max_tokens, q))
            p.start()
            res = q.get()
            p.join()
            if k:
                print(_summary("served", n, *res), flush=True)
    finally:
        stop_server(srv)


if __name__ == "__main__":
    main()
