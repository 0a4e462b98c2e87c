"""The engine's own host work per decode step (scheduler, block bookkeeping, stop checks, request outputs),
with the model runner stubbed out: on a GPU this work leaves the GPU idle between two decode graphs unless
it is overlapped (``sparrow bench --profile`` prints that idle time; overlapped decode, switches.OVERLAP, hides it).

    python benchmarks/engine_host.py [--batch-sizes 1,64] [--tokens 32,1000]

For each batch size B, B greedy requests (16-token prompts) run on a tiny random Llama (CPU; the runner's
``run`` returns token 7 for every sampled row without running the model), and the script prints the mean wall
time of ``Engine.step()`` over the 50 steps before each output length in ``--tokens``.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--tokens", default="64,1000", help="output lengths at which the step time is taken")
    args = ap.parse_args()

    from sparrow import LLM, SamplingParams
    import torch

    from sparrow.engine.step_plan import StepResult
    from tests.helpers import build_tiny_llama, random_prompts

    marks = sorted(int(t) for t in args.tokens.split(","))
    path = build_tiny_llama(pathlib.Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=16 + marks[-1] + 1)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        llm = LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_seqs=batch,
                  max_model_len=16 + marks[-1] + 1)
        eng = llm.engine

        def run(plan, previous=None):  # every sampled row picks token 7, no model
            return StepResult(torch.full((sum(s.num_sampled for s in plan.seqs),), 7, dtype=torch.int64))

        eng.runner.run = run
        params = SamplingParams(temperature=0.0, max_tokens=marks[-1], ignore_eos=True)
        for p in random_prompts([16] * batch):
            eng.add_request({"prompt_token_ids": p}, params)
        made, line = 0, []
        for mark in marks:
            while made < mark - 50:
                eng.step()
                made += 1
            t0 = time.perf_counter()
            while made < mark:
                eng.step()
                made += 1
            line.append(f"{(time.perf_counter() - t0) / 50 * 1e6:7.1f} us at {mark} tokens")
        print(f"batch {batch:4d}: engine host work per decode step " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
