"""Compile the kernels of the step compositions a server meets, before it takes requests.

Triton compiles a kernel variant the first time it runs: per tile config (chosen from the step's row count, e.g.
the FP8 GEMM's and the MoE grouped path's) and per specialization of its integer arguments (a row count of 1, a
multiple of 16, or neither). Decode steps of every batch bucket are compiled when their CUDA graphs are captured;
prefill steps and steps mixing prefill chunks with decode rows are not, and their row counts depend on how
requests happen to arrive. Without a warm-up a loaded server stalls for seconds on each new composition during its
first minutes of load.

``warm_up`` runs prefill steps of a ladder of token counts (powers of two up to the step's token budget, each
also one more: the two specializations) alone and then beside a ladder of decoding sequences (1, 2, 3, 4, 5, 8,
9, ... up to max_num_seqs - 1), with random token ids, and frees everything. A step larger than the longest
prompt max_model_len allows is made of several prompts, as a loaded server's steps are (with a short
max_model_len, single-prompt steps would leave the loaded server's large steps of many prompts uncompiled).
Kernels whose integer arguments vary with the step (row, pair and sequence counts) are marked
``do_not_specialize``, so what is left to compile is one variant per tile config. Compiled kernels are cached on
disk by Triton, so a restarted server warms up in seconds.
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


def split_prompt_lengths(n: int, cap: int) -> list[int]:
    """``n`` prompt tokens as the fewest prompts of at most ``cap`` tokens each, near-equal lengths (longest first).
    Raises ValueError for ``cap`` < 1."""
    if cap < 1:
        raise ValueError(f"warm-up prompts need max_model_len >= 3, got a longest prompt of {cap} tokens")
    k = -(-n // cap)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def warm_up(engine, seed: int = 0) -> int:
    """Run the warm-up steps on ``engine`` (idle: no request of its own may be running) and return how many
    steps ran. Prompts are random ids below the vocabulary size, each at most max_model_len - 2 tokens; a step's
    prompt tokens stop at the step's token budget and its sequences at max_num_seqs. Every request is finished
    and its blocks freed on return. FP8 KV scales still to be measured (calculate_kv_scales) are left for the
    first real prefill."""
    import contextlib

    runners = [engine.runner, getattr(getattr(engine.spec, "proposer", None), "runner", None)]
    with contextlib.ExitStack() as stack:
        for runner in runners:
            if runner is not None:
                stack.enter_context(runner.kv_cache.holding_scales())
        return _warm_up(engine, seed)


def _warm_up(engine, seed: int) -> int:
    cfg = engine.config
    rng = random.Random(seed)
    vocab = cfg.model.vocab_size
    budget, max_seqs = cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs
    cap = cfg.max_model_len - 2
    sizes = [n for n in prefill_lengths(budget) if len(split_prompt_lengths(n, cap)) <= max_seqs]
    steps = 0
    once = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    decode_prompt = min(8, cap)
    life = max(1, min(4 * len(sizes), cfg.max_model_len - decode_prompt - 1))  # tokens a decoder may generate
    long = SamplingParams(temperature=0.0, max_tokens=life, ignore_eos=True)
    names = iter(range(1 << 62))

    def add(n: int, params: SamplingParams, tag: str) -> list[str]:
        ids = []
        for length in split_prompt_lengths(n, cap):
            rid = f"warmup-{tag}-{next(names)}"
            engine.add_request({"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}, params,
                               request_id=rid)
            ids.append(rid)
        return ids

    def step() -> None:
        nonlocal steps
        engine.step()
        steps += 1

    def drain() -> None:
        while engine.has_unfinished_requests():
            step()

    for n in sizes:  # prefill alone
        add(n, once, "prefill")
        drain()
    for decoders in prefill_lengths(max_seqs - 1):  # prefill steps beside decode rows
        running, age = [], life
        for n in sizes:
            if n + decoders > budget or len(split_prompt_lengths(n, cap)) + decoders > max_seqs:
                continue
            if age + 2 >= life:  # the decoders would finish within this size's two steps: new ones
                for rid in running:
                    engine.abort(rid)
                running = [rid for _ in range(decoders) for rid in add(decode_prompt, long, "decode")]
                step()
                age = 1
            add(n, once, "mixed")
            step()
            step()
            age += 2
        for rid in running:
            engine.abort(rid)
        drain()
    return steps
