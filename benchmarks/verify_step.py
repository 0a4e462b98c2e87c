"""Cost of a speculative verify step: one step of B sequences with q rows each (the last token + q - 1 draft
tokens), against the 1-row decode step, on a random-weight model of a named shape; then the kernels of one
layer (dense linears, dense MLP, MoE experts) at the row counts of such steps.

    python benchmarks/verify_step.py                       (gemma4-26b-a4b, FP8 weights, batches 1 and 8)
    python benchmarks/verify_step.py --batch-sizes 1 --q 1 2 3 5 8 --context 512 --out verify.json
    python benchmarks/verify_step.py --device cpu --model-shape tiny-gemma4 --steps 3 --warmup 1   (smoke run)

Steps: the model is built as ``sparrow bench --model-shape NAME --quantization fp8`` builds it (transformers'
random init, copied into sparrow's model, quantized at load), and a ``ModelRunner`` whose CUDA graphs cover
every q of ``--q`` (``query_lens``). Each batch's sequences are prefilled with ``--context`` random tokens
(one eager step) and given their first sampled token; then every q is timed on the same sequences: the plan
has ``ScheduledSeq(seq, context, q, num_sampled=q, draft_token_ids=[q - 1 random ids])`` per sequence (greedy:
``argmax_only``), so each step writes K/V at positions context .. context + q - 1 and attends over context + q
tokens: the same positions every step, as after a verify step whose drafts were all rejected. Per q:

- step us: median wall time of ``runner.run(plan)`` plus reading its tokens, between two CUDA events with the
  GPU idle at the start (host staging + input copies + graph replay + argmax), after ``--warmup`` steps;
- graph us: the captured graph of (bucket, q) replayed back to back (GPU time alone; CUDA only);
- x q=1: each divided by the q = 1 figure of the same batch (issue 24's target: q = 5 at most 1.4 x);
- MB/step and bound us: the bytes a step must read (``sparrow.bench.footprint``: every non-expert weight,
  the LM head, the experts that B x q uniformly routed tokens hit, the KV cache at context + q) and their
  time at the copy bandwidth. Random routers route about uniformly, so the experts' bytes grow with the
  rows as 1 - (1 - k/E)^(B q): the worst case for a verify step (a trained model's consecutive tokens often
  share experts).

Kernels (``--kernel-rows``, default 1 2 3 4 5 8; ``--no-kernels`` skips them): the modules of the model's
first layer as the engine calls them (FP8: the W8A8 GEMV up to 16 rows, sparrow/kernels/gemm/gemv.py; the MoE
experts' small path up to 64 (row, expert) pairs, sparrow/kernels/moe/moe.py, with ``reduce=False`` as Gemma 4
calls them). Each call goes to the next layer of the same shape (and the experts to the next of 16 random
routings), so weights come from HBM, not L2; on CUDA timed by ``gpu_timing.time_s`` (CUDA-graph replay, as
kernels_micro.py and moe_layer.py time theirs). Bytes: the module's weights (the experts: those the routing
hits, mean over the routings) + its input and output; GB/s = bytes / time.

JSON (``--out``): meta (shape, quantization, device, copy bandwidth, context), ``steps`` (one entry per
batch and q) and ``kernels`` (one per kernel and row count).
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

N_ROUTINGS = 16
TARGET_Q, TARGET_RATIO = 5, 1.4  # issue 24: a 5-row verify step at most 1.4 x the 1-row step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="gemma4-26b-a4b", help="a named shape of sparrow/model_shapes.py")
    p.add_argument("--quantization", default="fp8", help="weight format at load ('none': the model dtype)")
    p.add_argument("--quantize-lm-head", action="store_true", help="with fp8: the LM head in FP8 too")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--q", type=int, nargs="+", default=[1, 2, 3, 5, 8], help="rows per sequence (1: decode)")
    p.add_argument("--context", type=int, default=128, help="tokens in each sequence's KV cache before the step")
    p.add_argument("--steps", type=int, default=200, help="timed steps per point (the median is reported)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    p.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    p.add_argument("--no-kernels", action="store_true", help="skip the per-kernel breakdown")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (eager steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("batch_sizes", "q", "kernel_rows"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} needs positive integers")
    if args.context < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--context and --steps must be at least 1, --warmup at least 0")
    if 1 not in args.q:
        args.q = [1] + args.q  # the ratios need the 1-row step
    args.q = sorted(set(args.q))
    if args.out and not args.out.parent.is_dir():
        p.error(f"--out {args.out}: the folder {args.out.parent} does not exist")
    return args


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def median_step_s(fn, steps: int, warmup: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls after ``warmup`` calls; each call starts with the device
    idle and is timed between two CUDA events (wall clock on CPU), so host work before its launches counts."""
    for _ in range(warmup):
        fn()
    _sync(cuda)
    times = []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- the model


def build(args):
    """(sparrow model, footprint, full config dict, Settings) for the named shape, its random weights streamed
    in one module at a time (``bench.runners.sparrow_model_random``)."""
    from sparrow.bench.footprint import footprint
    from sparrow.bench.runners import _free, sparrow_model_random
    from sparrow.bench.settings import Settings
    from sparrow.devices import resolve_device, resolve_dtype
    from sparrow.model_shapes import full_config_dict, shape_config

    device = resolve_device(args.device)
    quant = None if args.quantization in (None, "", "none") else args.quantization
    s = Settings(device=device, dtype=resolve_dtype(args.dtype, device), batch_sizes=args.batch_sizes,
                 prompt_lens=[args.context], decode_tokens=max(args.q) + 1, seed=args.seed,
                 enforce_eager=args.enforce_eager, quantization=quant, quantize_lm_head=args.quantize_lm_head)
    cfg = shape_config(args.model_shape)
    full = full_config_dict(cfg)
    label = f"{s.dtype}" + (f", {quant} weights" if quant else "")
    print(f"building random-weight {args.model_shape} ({label}) on {device} ...", flush=True)
    model = sparrow_model_random(cfg, full, s)
    _free(device)
    fp = footprint(model, full, bool(full.get("tie_word_embeddings")), int(full["hidden_size"]))
    return model, fp, full, s


def make_runner(model, s, args):
    """A ModelRunner over ``model`` whose KV pool holds the largest batch at context + max q, with CUDA graphs
    for every q of ``args.q`` (on CUDA, unless --enforce-eager)."""
    from sparrow.config import CacheConfig
    from sparrow.llm import engine_config
    from sparrow.engine.model_runner import ModelRunner

    top, mml = max(args.batch_sizes), args.context + max(args.q) + 1
    blocks = top * -(-mml // CacheConfig.block_size) + top
    config = engine_config(model.config, device=s.device, dtype=s.dtype, max_model_len=mml, num_kv_blocks=blocks,
                           enable_prefix_caching=False, max_num_seqs=top, max_num_batched_tokens=max(top * mml, 256),
                           enforce_eager=s.enforce_eager)
    return ModelRunner(config, model, query_lens=tuple(args.q))


def prefill(runner, batch: int, context: int, max_q: int, vocab: int, gen: torch.Generator):
    """``batch`` sequences of ``context`` random prompt tokens, their blocks allocated for context + max_q
    tokens, prefilled in one eager step; each gets its sampled token appended. Returns (sequences, block
    manager)."""
    from sparrow.engine.block_manager import BlockManager
    from sparrow.engine.sequence import Sequence, SequenceStatus
    from sparrow.engine.step_plan import ScheduledSeq, StepPlan
    from sparrow.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_q + 1, ignore_eos=True)
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    prompts = torch.randint(4, vocab, (batch, context), generator=gen).tolist()
    seqs = [Sequence(str(i), 0, p, params, set()) for i, p in enumerate(prompts)]
    for seq in seqs:
        bm.allocate(seq, context + max_q)
        seq.status = SequenceStatus.RUNNING
    plan = StepPlan([ScheduledSeq(seq, 0, context, num_sampled=1) for seq in seqs], argmax_only=True)
    for seq, token in zip(seqs, runner.run(plan).token_ids()):
        seq.output_token_ids.append(token)
        seq.num_computed_tokens = context
    return seqs, bm


def verify_plan(seqs, context: int, q: int, vocab: int, gen: torch.Generator):
    """The step of every sequence verifying q - 1 random draft tokens at positions context .. context + q - 1."""
    from sparrow.engine.step_plan import ScheduledSeq, StepPlan

    drafts = torch.randint(4, vocab, (len(seqs), q - 1), generator=gen).tolist()
    return StepPlan([ScheduledSeq(seq, context, q, num_sampled=q, draft_token_ids=d) for seq, d in zip(seqs, drafts)],
                    argmax_only=True)


def step_bytes(fp, batch: int, q: int, context: int) -> dict[str, float]:
    """Bytes one step of ``batch`` sequences x ``q`` rows must read (``Footprint.step_bytes`` with the experts hit
    by batch x q tokens, the embedding rows of batch x q tokens and the KV cache at context + q)."""
    out = fp.step_bytes(batch, context + q)
    out["experts"] = fp.weight_bytes.get("experts", 0) * fp.expert_hit_fraction(batch * q)
    out["embedding"] = float(batch * q * fp.hidden * fp.element_size)
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def time_steps(runner, fp, args, bandwidth: float, vocab: int) -> list[dict]:
    """One entry per (batch, q): step and graph seconds, bytes and bound, ratios to q = 1 of the batch."""
    from sparrow.bench.timing import graph_replay_s

    cuda = runner.device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed + 1)
    results = []
    for batch in args.batch_sizes:
        seqs, bm = prefill(runner, batch, args.context, max(args.q), vocab, gen)
        base = None
        for q in args.q:
            plan = verify_plan(seqs, args.context, q, vocab, gen)
            graphed = runner.graphs is not None and runner.graphs.bucket_for(batch, q) is not None
            step = median_step_s(lambda: runner.run(plan).token_ids(), args.steps, args.warmup, cuda)
            graph = None
            if graphed:
                graph = statistics.median(graph_replay_s(runner.graphs, batch, q) for _ in range(5))
            nbytes = step_bytes(fp, batch, q, args.context)
            row = {"batch": batch, "q": q, "rows": batch * q, "draft_tokens": q - 1, "context": args.context,
                   "cuda_graph": graphed, "step_us": step * 1e6, "graph_us": graph * 1e6 if graph else None,
                   "bytes_per_step": nbytes["total"], "bytes_per_step_by_group": nbytes,
                   "bound_us": nbytes["total"] / bandwidth * 1e6}
            base = base or row
            row["step_x_q1"] = row["step_us"] / base["step_us"]
            row["graph_x_q1"] = row["graph_us"] / base["graph_us"] if graph and base["graph_us"] else None
            row["bound_x_q1"] = row["bound_us"] / base["bound_us"]
            row["pct_of_bound"] = 100 * row["bound_us"] / row["step_us"]
            results.append(row)
            print(_step_line(row), flush=True)
        for seq in seqs:
            bm.free_seq(seq)
    return results


STEP_HEADER = (f"{'batch':>5} {'q':>2} {'rows':>4} | {'step us':>9} {'x q=1':>6} | {'graph us':>9} {'x q=1':>6} | "
               f"{'MB/step':>8} {'bound us':>9} {'x q=1':>6} {'% bound':>7}")


def _step_line(r: dict) -> str:
    graph = f"{r['graph_us']:9.1f} {r['graph_x_q1']:6.2f}" if r["graph_us"] else f"{'-':>9} {'-':>6}"
    return (f"{r['batch']:5d} {r['q']:2d} {r['rows']:4d} | {r['step_us']:9.1f} {r['step_x_q1']:6.2f} | {graph} | "
            f"{r['bytes_per_step'] / 1e6:8.1f} {r['bound_us']:9.1f} {r['bound_x_q1']:6.2f} {r['pct_of_bound']:6.1f}%")


def target_lines(steps: list[dict]) -> list[str]:
    """Issue 24's target per batch: the q = TARGET_Q step at most TARGET_RATIO x the q = 1 step (the step as the
    engine runs it, and its graph replay alone where there is one)."""
    lines = []
    for r in steps:
        if r["q"] == TARGET_Q:
            ratios = [("step", r["step_x_q1"])] + ([("graph replay", r["graph_x_q1"])] if r["graph_x_q1"] else [])
            text = ", ".join(f"{name} {x:.2f} x q=1 ({'met' if x <= TARGET_RATIO else 'not met'})" for name, x in ratios)
            lines.append(f"target batch {r['batch']}: q={TARGET_Q} at most {TARGET_RATIO} x q=1: {text}; the bytes "
                         f"bound alone grows {r['bound_x_q1']:.2f} x")
    return lines


# ---------------------------------------------------------------------------------------------- kernels


def _module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's weights: parameters and buffers (quantized weights and their scales)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _same_layers(model) -> list:
    """The layers with the first layer's shapes (its attention kind, MoE or not): a rotation that keeps the
    weights of consecutive calls apart."""
    layers = list(model.model.layers)
    ref = layers[0]

    def key(layer):
        return (layer.self_attn.qkv_proj.out_features, getattr(layer, "moe", False))

    return [layer for layer in layers if key(layer) == key(ref)]


def _timer(cuda: bool, steps: int):
    if cuda:
        from gpu_timing import time_s  # beside this script

        return time_s
    return lambda fn: median_step_s(fn, steps, 1, False)


def kernel_breakdown(model, args, bandwidth: float) -> list[dict]:
    """us and GB/s of one layer's dense linears, dense MLP and MoE experts at each of ``args.kernel_rows``."""
    layers = _same_layers(model)
    ref = layers[0]
    device = next(ref.parameters()).device
    dtype = ref.input_layernorm.weight.dtype
    cuda = device.type == "cuda"
    timer = _timer(cuda, max(3, min(args.steps, 20)))
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    modules = {
        "qkv_proj": lambda layer: layer.self_attn.qkv_proj,
        "o_proj": lambda layer: layer.self_attn.o_proj,
        "mlp.gate_up_proj": lambda layer: layer.mlp.gate_up_proj,
        "mlp.down_proj": lambda layer: layer.mlp.down_proj,
    }
    print(f"kernels of layer 0 ({len(layers)} layers of its shape in rotation, weights from HBM):", flush=True)
    print(f"{'kernel':<18} {'rows':>4} {'K':>5} {'N':>6} | {'us':>9} {'x rows=1':>8} {'MB':>8} {'GB/s':>8} "
          f"{'% copy':>7}", flush=True)
    results = []
    for name, get in modules.items():
        mods = [get(layer) for layer in layers]
        k, n = mods[0].in_features, mods[0].out_features
        for rows in args.kernel_rows:
            x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
            nbytes = _module_bytes(mods[0]) + rows * (k + n) * x.element_size()
            results.append(_kernel_row(name, rows, k, n, timer, _rotation(mods, lambda m: m(x)), nbytes, bandwidth))
    h = ref.mlp.gate_up_proj.in_features
    inter = ref.mlp.down_proj.in_features
    for rows in args.kernel_rows:
        x = torch.randn(rows, h, device=device, generator=gen).to(dtype)
        nbytes = _module_bytes(ref.mlp) + rows * (2 * h + 3 * inter) * x.element_size()
        results.append(_kernel_row("dense MLP", rows, h, inter, timer,
                                   _rotation([layer.mlp for layer in layers], lambda m: m(x)), nbytes, bandwidth))
    if getattr(ref, "moe", False):
        results += _moe_rows(layers, args.kernel_rows, dtype, gen, timer, bandwidth)
    _ratios(results)
    for r in results:
        print(_kernel_line(r), flush=True)
    return results


def _rotation(mods: list, call):
    """A function that calls ``call`` on the next module of ``mods`` each time."""
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % len(mods)
        return call(mods[state["i"]])

    return fn


def _moe_rows(layers, rows_list, dtype, gen, timer, bandwidth: float) -> list[dict]:
    """The routed experts (``FusedMoE`` with reduce=False, as Gemma 4 calls them) at each row count: each call
    the next layer and the next of N_ROUTINGS random top-k routings (softmax of normal logits, as moe_layer.py)."""
    experts = [layer.experts for layer in layers]
    e0 = experts[0]
    n_exp, h, top_k = e0.num_experts, e0.hidden_size, layers[0].router.top_k
    per_expert = _module_bytes(e0) / n_exp
    device = next(e0.parameters()).device
    out = []
    for rows in rows_list:
        x = torch.randn(rows, h, device=device, generator=gen).to(dtype)
        routings = []
        for _ in range(N_ROUTINGS):
            w, ids = torch.softmax(torch.randn(rows, n_exp, device=device, generator=gen), -1).topk(top_k, dim=-1)
            routings.append((w.to(dtype), ids.to(torch.int32)))
        hit = sum(len(torch.unique(ids)) for _, ids in routings) / N_ROUTINGS
        state = {"i": 0}

        def fn():
            state["i"] += 1
            w, ids = routings[state["i"] % N_ROUTINGS]
            return experts[state["i"] % len(experts)](x, w, ids, reduce=False)

        nbytes = hit * per_expert + rows * h * x.element_size() * (1 + top_k) + rows * top_k * 8
        pairs = rows * top_k
        path = "small" if pairs <= min(e0.pair_threshold, 256) else "grouped"
        row = _kernel_row(f"MoE experts {path}", rows, h, e0.intermediate_size, timer, fn, nbytes, bandwidth)
        row.update(pairs=pairs, experts_hit=hit)
        out.append(row)
    return out


def _kernel_row(name, rows, k, n, timer, fn, nbytes, bandwidth: float) -> dict:
    with torch.inference_mode():
        fn()  # compile outside any capture
        t = timer(fn)
    return {"kernel": name, "rows": rows, "K": k, "N": n, "us": t * 1e6, "bytes": nbytes, "gbps": nbytes / t / 1e9,
            "pct_copy": 100 * nbytes / t / bandwidth}


def _ratios(results: list[dict]) -> None:
    base = {}
    for r in results:
        base.setdefault(r["kernel"], r["us"] if r["rows"] == 1 else None)
        r["us_x_rows1"] = r["us"] / base[r["kernel"]] if base[r["kernel"]] else None


def _kernel_line(r: dict) -> str:
    ratio = f"{r['us_x_rows1']:8.2f}" if r["us_x_rows1"] else f"{'-':>8}"
    return (f"{r['kernel']:<18} {r['rows']:4d} {r['K']:5d} {r['N']:6d} | {r['us']:9.2f} {ratio} "
            f"{r['bytes'] / 1e6:8.2f} {r['gbps']:8.1f} {r['pct_copy']:6.1f}%")


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    from sparrow.bench.timing import copy_bandwidth

    args = parse_args(argv)
    model, fp, full, s = build(args)
    bandwidth = copy_bandwidth(s.device)
    name = torch.cuda.get_device_name() if s.device.startswith("cuda") else "cpu"
    print(f"{name}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); {args.model_shape}, {s.dtype}"
          f"{', ' + s.quantization + ' weights' if s.quantization else ''}; context {args.context}, median of "
          f"{args.steps} steps after {args.warmup}", flush=True)
    runner = make_runner(model, s, args)
    report = {"meta": {"model_shape": args.model_shape, "quantization": s.quantization, "dtype": s.dtype,
                       "device": s.device, "device_name": name, "copy_bandwidth_GBps": bandwidth / 1e9,
                       "context": args.context, "steps": args.steps, "warmup": args.warmup, "q": args.q,
                       "batch_sizes": args.batch_sizes, "torch": torch.__version__,
                       "weight_bytes": fp.weight_bytes, "num_experts": fp.num_experts, "top_k": fp.top_k},
              "steps": [], "kernels": []}
    print(STEP_HEADER, flush=True)
    report["steps"] = time_steps(runner, fp, args, bandwidth, int(full["vocab_size"]))
    report["targets"] = target_lines(report["steps"])
    for line in report["targets"]:
        print(line, flush=True)
    _write(args.out, report)
    del runner
    gc.collect()
    if not args.no_kernels:
        report["kernels"] = kernel_breakdown(model, args, bandwidth)
        _write(args.out, report)
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)
    return report


def _write(path, report: dict) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
