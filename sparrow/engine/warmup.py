"""Compile the kernels of the step compositions a server meets, before it takes requests.

Triton compiles a kernel variant the first time it runs: per tile config (chosen from the step's row count, e.g.
the FP8 GEMM's and the MoE grouped path's) and per specialization of its integer arguments (a row count of 1, a
multiple of 16, or neither). Decode steps of every batch bucket are compiled when their CUDA graphs are captured;
prefill steps and steps mixing prefill chunks with decode rows are not, and their row counts depend on how
requests happen to arrive. Measured on the H200 (gemma4-26b-a4b FP8, ``benchmarks/serve.py`` at 64 streams): six
steps of 0.9 to 7 s each, one per new composition, during the first minutes of load.

``warm_up`` runs prefills of a ladder of lengths (powers of two up to the step's token budget, each also one
longer: the two specializations) alone and then beside a ladder of decoding sequences (1, 2, 3, 4, 5, 8, 9, ...
up to max_num_seqs - 1), with random token ids, and frees everything. On the H200 the first version (prefills
beside 4 decoders only) left three stalls of 0.8-5.3 s at 64 running sequences. Compiled kernels are cached on disk by Triton, so a restarted server warms up in seconds.
"""
from __future__ import annotations

import random

from sparrow.sampling_params import SamplingParams


def prefill_lengths(max_tokens: int) -> list[int]:
    """Prompt lengths of the warm-up, ascending: 1, 2, 3, 4, 5, 8, 9, ..., each power of two p <= ``max_tokens``
    and p + 1 when it fits (p + 1 and p specialize differently)."""
    out, p = set(), 1
    while p <= max_tokens:
        out.add(p)
        if p + 1 <= max_tokens:
            out.add(p + 1)
        p *= 2
    return sorted(out)


def warm_up(engine, seed: int = 0) -> int:
    """Run the warm-up steps on ``engine`` (idle: no request of its own may be running) and return how many
    steps ran. Prompts are random ids below the vocabulary size; prompt lengths stop at the step's token budget
    and below max_model_len. Every request is finished and its blocks freed on return."""
    cfg = engine.config
    rng = random.Random(seed)
    vocab = cfg.model.vocab_size
    budget = min(cfg.scheduler.max_num_batched_tokens, cfg.max_model_len - 2)
    lengths = prefill_lengths(budget)
    steps = 0

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}

    def drain() -> None:
        nonlocal steps
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1

    once = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for n in lengths:  # prefill alone
        engine.add_request(prompt(n), once, request_id=f"warmup-{n}")
        drain()
    for decoders in prefill_lengths(cfg.scheduler.max_num_seqs - 1):  # prefill chunks beside decode rows
        _mixed(engine, decoders, lengths, budget, prompt, once)
        steps += 1 + 2 * len([n for n in lengths if n + decoders <= budget])
        drain()
    return steps


def _mixed(engine, decoders: int, lengths: list[int], budget: int, prompt, once: SamplingParams) -> None:
    """``decoders`` requests decoding while a prefill of each length (that fits the budget beside them) runs."""
    long = SamplingParams(temperature=0.0, max_tokens=max(1, min(2 * len(lengths) + 4, engine.config.max_model_len - 9)),
                          ignore_eos=True)
    for i in range(decoders):
        engine.add_request(prompt(8), long, request_id=f"warmup-decode-{decoders}-{i}")
    engine.step()
    for n in lengths:
        if n + decoders > budget:
            break
        engine.add_request(prompt(n), once, request_id=f"warmup-mixed-{decoders}-{n}")
        engine.step()
        engine.step()
    for i in range(decoders):
        engine.abort(f"warmup-decode-{decoders}-{i}")
