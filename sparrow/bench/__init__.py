"""``sparrow bench``: prefill and decode speed of sparrow and of HF transformers on the same weights, in one
run, against the memory-bandwidth bound.

For each (batch B, prompt length P) one greedy run of N new tokens per sequence is timed per step (sparrow:
engine steps; transformers: a streamer in ``generate``). TTFT = time until every sequence has its first
token (that run's "max_tokens=1" part); decode tok/s = tokens after that / the time they took. Bytes read per
decode step = non-expert weights + LM head + the experts B rows are expected to touch + the KV cache at the
mean decode context; % of bound = (bytes / copy bandwidth) / step time, with the copy bandwidth measured at
the start of the same run. ``ignore_eos`` (HF: min_new_tokens = max_new_tokens), fresh random prompts per
run (no prefix-cache hits). See benchmarks/README.md.

Modules: ``settings`` (the resolved flags), ``footprint`` (bytes per step), ``timing`` (runners, one measured
point, profiles), ``runners`` (building the models), ``report`` (table, JSON), ``run`` (``run_bench``).
"""
from sparrow.bench.footprint import Footprint, footprint
from sparrow.bench.run import run_bench
from sparrow.bench.runners import engine_kwargs, shape_runners, sparrow_from_shape
from sparrow.bench.settings import Settings, resolve_settings
from sparrow.bench.timing import HFRunner, SparrowRunner, copy_bandwidth, measure

__all__ = ["Footprint", "HFRunner", "Settings", "SparrowRunner", "copy_bandwidth", "engine_kwargs", "footprint",
           "measure", "resolve_settings", "run_bench", "shape_runners", "sparrow_from_shape"]
