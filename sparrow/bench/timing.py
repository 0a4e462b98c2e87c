"""Timed runs: the copy bandwidth, random prompts, the sparrow and transformers runners, one measured point
and the profiler tables of one decode step and of one prefill."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch


from sparrow.bench.footprint import Footprint
from sparrow.bench.settings import Settings


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    """Wall seconds of fn(), synchronized on CUDA."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large same-device tensor copy (bytes read + bytes written per second), best of
    several: 1 GiB on CUDA (less when memory is short; timed with CUDA events over 10 back-to-back copies),
    256 MiB on CPU."""
    cuda = device.startswith("cuda")
    nbytes = min(1 << 30, torch.cuda.mem_get_info()[0] // 8) if cuda else 256 << 20
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / 10)
        else:
            times.append(_timed(lambda: dst.copy_(src), device))
    del src, dst
    return 2 * nbytes / min(times)


def random_prompts(batch: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    """``batch`` prompts of ``length`` random token ids in [4, vocab) (ids 0-3 are usually special)."""
    return torch.randint(4, vocab, (batch, length), generator=gen).tolist()


@dataclass
class Timing:
    """One generate run, split at the moment every sequence has its first token."""

    ttft_s: float
    """Seconds from the start until every sequence of the batch has its first token (prefill + 1 token)."""
    decode_s: float
    """Seconds from then until the last token."""
    decode_tokens: int
    """Tokens generated after the first-token moment, all sequences together."""
    decode_steps: int
    """Forward steps after the first-token moment."""
    total_tokens: int
    """Tokens generated, all sequences together."""


class SparrowRunner:
    """Drives sparrow's ``Engine`` step by step (token-id prompts, greedy, ignore_eos), timing each step."""

    name = "sparrow"

    def __init__(self, engine):
        self.engine = engine

    def run(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        """Generate ``new_tokens`` per prompt. (Each step's sampled ids reach the host, so the step's
        end time needs no extra synchronization.)"""
        from sparrow.sampling_params import SamplingParams

        eng = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        rids = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
        counts = dict.fromkeys(rids, 0)
        t_first, after, steps, now, idle = None, 0, 0, t0, 0
        try:
            while eng.has_unfinished_requests():
                outs = eng.step()
                now = time.perf_counter()
                idle = 0 if outs else idle + 1
                if idle > 1000:
                    raise RuntimeError("sparrow's scheduler made no progress for 1000 steps")
                new = 0
                for o in outs:
                    c = len(o.outputs[0].token_ids)
                    new, counts[o.request_id] = new + c - counts[o.request_id], c
                if t_first is not None:
                    after, steps = after + new, steps + 1
                elif all(counts.values()):
                    t_first = now
        except BaseException:
            for rid in rids:  # leave no half-run request behind
                eng.abort(rid)
            raise
        t_first = now if t_first is None else t_first
        return Timing(t_first - t0, now - t_first, after, steps, sum(counts.values()))

    def decode_stepper(self, prompts: list[list[int]]):
        """(one decode step of the batch of ``prompts``, cleanup): they are prefilled and two steps are
        warmed first."""
        from sparrow.sampling_params import SamplingParams

        eng = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        rids = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
        produced = dict.fromkeys(rids, 0)
        while min(produced.values()) < 3:  # prefill (maybe several chunks) + two decode steps
            for o in eng.step():
                produced[o.request_id] = len(o.outputs[0].token_ids)
        return eng.step, lambda: [eng.abort(r) for r in rids]


class _StepClock:
    """A transformers streamer that only records when each step's tokens are ready (the first call is
    the prompt, before prefill)."""

    def __init__(self, device: str):
        self.device, self.times = device, []

    def put(self, value) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFRunner:
    """Runs batches through transformers' ``generate`` (left-padded batch with attention mask, greedy,
    min_new_tokens = max_new_tokens so it never stops early), timing each step with a streamer."""

    name = "transformers"

    def __init__(self, model, device: str):
        self.model, self.device = model, device
        pad = getattr(model.generation_config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0

    def _batch(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        """Generate ``new_tokens`` per prompt."""
        ids, mask = self._batch(prompts)
        clock = _StepClock(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad_id,
                                  streamer=clock)
        _sync(self.device)
        end = time.perf_counter()
        ticks = clock.times[1:]  # one per generated token
        first = ticks[0] if ticks else end
        steps = max(len(ticks) - 1, 0)
        return Timing(first - t0, (ticks[-1] if ticks else end) - first, steps * len(prompts), steps,
                      (out.shape[1] - ids.shape[1]) * len(prompts))

    @torch.inference_mode()
    def decode_stepper(self, prompts: list[list[int]]):
        """(one decode step of the batch of equal-length ``prompts`` with the KV cache, cleanup)."""
        out = self.model(input_ids=torch.tensor(prompts, device=self.device), use_cache=True)
        state = {"past": out.past_key_values, "next": out.logits[:, -1:].argmax(-1)}

        @torch.inference_mode()
        def step():
            with warnings.catch_warnings():  # transformers >= 5.2x renames past_key_values to cache
                warnings.simplefilter("ignore", FutureWarning)
                o = self.model(input_ids=state["next"], past_key_values=state["past"], use_cache=True)
            state["past"], state["next"] = o.past_key_values, o.logits[:, -1:].argmax(-1)

        step()
        step()
        return step, state.clear


def measure(runner, s: Settings, batch: int, prompt_len: int, vocab: int, fp: Footprint, bandwidth: float,
            gen: torch.Generator) -> dict:
    """One row of the table: times in seconds, rates in tokens/s, bytes per decode step. A warm-up run first
    (CUDA graphs, Triton compiles, allocator); then ``s.repeats`` timed runs, the best reported (other work on
    the machine only ever slows a run down).

    sparrow's warm-up generates as many tokens as a timed run, so the timed runs meet no step composition the
    warm-up did not: with 2 warm-up tokens, 8 x 2048 prompts at an 8192-token step budget finished their
    prefill in a 7-row step (the MoE's small path) where the timed run's step had 11 rows (grouped path, a
    kernel variant not yet compiled), so the first timed TTFT included that compile.
    transformers (no shape-specialized kernels) warms up with 2 tokens."""
    n = s.decode_tokens
    runner.run(random_prompts(batch, prompt_len, vocab, gen), n if isinstance(runner, SparrowRunner) else 2)
    runs = [runner.run(random_prompts(batch, prompt_len, vocab, gen), n) for _ in range(s.repeats)]
    for t in runs:
        if t.total_tokens != batch * n or t.decode_steps < 1:
            raise RuntimeError(f"{runner.name} generated {t.total_tokens} tokens in {t.decode_steps + 1} steps, "
                               f"expected {batch * n} in {n}")
    ttft = min(t.ttft_s for t in runs)
    step = min(t.decode_s / t.decode_steps for t in runs)
    rate = max(t.decode_tokens / t.decode_s for t in runs)
    nbytes = fp.step_bytes(batch, prompt_len + n / 2)
    return {
        "engine": runner.name, "batch": batch, "prompt_len": prompt_len, "decode_tokens": n,
        "ttft_s": ttft, "prefill_tok_s": batch * prompt_len / ttft, "decode_step_s": step,
        "decode_tok_s_per_seq": rate / batch, "decode_tok_s": rate,
        "bytes_per_step": nbytes["total"], "bytes_per_step_by_group": nbytes,
        "bound_step_s": nbytes["total"] / bandwidth, "pct_of_bound": 100.0 * nbytes["total"] / bandwidth / step,
    }


def profile_step(runner, prompts: list[list[int]], device: str, rows: int = 20) -> str:
    """torch.profiler table of one decode step of the batch of ``prompts`` (equal lengths): the top ``rows``
    ops by self device time (CUDA) or self CPU time (CPU), with the step's wall time on top."""
    from torch.profiler import ProfilerActivity, profile

    step, cleanup = runner.decode_stepper(prompts)
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        wall = min(_timed(step, device) for _ in range(5))
        graph = _graph_alone(runner, len(prompts)) if cuda else None
        with profile(activities=acts) as prof:
            step()
            _sync(device)
    finally:
        cleanup()
    table = _table(prof, cuda, rows)
    split = ""
    if graph is not None:
        split = (f"; its decode graph alone {graph * 1e3:.2f} ms, so sampling + host work leave the GPU idle "
                 f"{(wall - graph) * 1e3:.2f} ms a step")
    return (f"{runner.name}: one decode step at batch {len(prompts)}, prompt {len(prompts[0])}: "
            f"{wall * 1e3:.2f} ms wall (best of 5){split}\n{table}")


def _graph_alone(runner, batch: int, reps: int = 20) -> float | None:
    """Seconds per replay of the captured decode graph of ``batch`` rows (``graph_replay_s``) of a runner's
    engine; None without a graph (eager engine)."""
    graphs = getattr(getattr(getattr(runner, "engine", None), "runner", None), "graphs", None)
    return graph_replay_s(graphs, batch, 1, reps) if graphs is not None else None


def graph_replay_s(graphs, batch: int, q: int = 1, reps: int = 20) -> float | None:
    """Seconds per replay of the captured graph of ``batch`` sequences of ``q`` rows each (a ModelRunner's
    ``DecodeGraphs``; its inputs as the last step left them, so KV writes go to the slots of that step
    again), back to back: the step's GPU time without the engine's host work or the sampler; None when that
    (bucket, q) has no graph."""
    bucket = graphs.bucket_for(batch, q)
    if bucket is None:
        return None
    graph = graphs.graphs[bucket, q]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def profile_prefill(runner, prompts: list[list[int]], device: str, rows: int = 25) -> str:
    """torch.profiler table of prefilling ``prompts`` (all steps until each has its first token; warmed
    once first): the top ``rows`` ops by self device time (CUDA) or self CPU time, with the wall time."""
    from torch.profiler import ProfilerActivity, profile

    runner.run(prompts, 1)
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall = _timed(lambda: runner.run(prompts, 1), device)
    return (f"{runner.name}: prefill of {len(prompts)} x {len(prompts[0])} tokens: {wall * 1e3:.1f} ms wall "
            f"(under the profiler)\n{_table(prof, cuda, rows)}")


def _table(prof, cuda: bool, rows: int) -> str:
    avg = prof.key_averages()
    for key in (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:
            return avg.table(sort_by=key, row_limit=rows)
        except (AttributeError, KeyError, ValueError):
            continue
    return "(no profiler table)"


# ---------------------------------------------------------------------------------------------- models
