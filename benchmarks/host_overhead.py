"""Host time of the engine per decode step, outside the model runner: scheduling, block bookkeeping (prefix
hashes), sampling bookkeeping, finish checks. Runs on the CPU with a tiny random Llama (the runner's time is
timed separately and left out), so it isolates the Python work that a GPU step pays on top of its kernels.

    python benchmarks/host_overhead.py [--batch 64] [--prompt-len 2048] [--steps 20]

Prints, with prefix caching on (the engine's default) and off (sparrow bench's setting): ms per step in
total, in the runner, and the rest.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    import torch

    from sparrow import LLM, SamplingParams
    from tests.helpers import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_llama(pathlib.Path(tmp) / "tiny", max_position_embeddings=args.prompt_len + args.steps + 64)
        gen = torch.Generator().manual_seed(3)
        prompts = torch.randint(4, 256, (args.batch, args.prompt_len), generator=gen).tolist()
        for prefix in (True, False):
            llm = LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True,
                      max_model_len=args.prompt_len + args.steps + 8, enable_prefix_caching=prefix,
                      max_num_seqs=args.batch, max_num_batched_tokens=max(8192, args.prompt_len))
            engine = llm.engine
            params = SamplingParams(max_tokens=args.steps + 4, ignore_eos=True, temperature=0.0)
            for ids in prompts:
                engine.add_request({"prompt_token_ids": ids}, params)
            while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):
                engine.step()  # prefill
            runner_s = [0.0]
            run = engine.runner.run

            def timed(plan, previous=None, run=run):
                t0 = time.perf_counter()
                out = run(plan, previous)
                runner_s[0] += time.perf_counter() - t0
                return out

            engine.runner.run = timed
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            total = (time.perf_counter() - t0) / args.steps
            runner = runner_s[0] / args.steps
            print(f"batch {args.batch}, prompt {args.prompt_len}, prefix caching {'on ' if prefix else 'off'}: "
                  f"step {total * 1e3:7.2f} ms, runner {runner * 1e3:7.2f} ms, host rest {(total - runner) * 1e3:6.2f} ms")
            del llm, engine


if __name__ == "__main__":
    main()
