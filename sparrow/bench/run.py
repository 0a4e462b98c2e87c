"""``sparrow bench`` itself: settings -> bandwidth -> each runner at each point -> table and JSON."""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from sparrow.errors import InvalidRequestError

from sparrow.bench.report import _progress, _write_json, format_table
from sparrow.bench.runners import _free, engine_kwargs, path_runners, shape_runners
from sparrow.bench.settings import Settings, resolve_settings
from sparrow.bench.timing import HFRunner, SparrowRunner, copy_bandwidth, measure, profile_prefill, profile_step, random_prompts


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meta(args, s: Settings) -> dict:
    import transformers

    meta = {"model": str(args.model) if args.model else None, "model_shape": args.model_shape,
            "settings": asdict(s), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
            "load_average_start": os.getloadavg()}
    if s.device.startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name()
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
    else:
        meta["device_name"] = _cpu_name()
    return meta


def run_bench(args) -> int:
    """``sparrow bench``: measure, print the table (and profiles), write ``--out`` JSON. Returns the exit
    status: 0, or 1 when some measurement failed (its row says why)."""
    import transformers

    transformers.logging.set_verbosity_error()
    s = resolve_settings(args)
    if args.model and args.model_shape:
        raise InvalidRequestError("give --model or --model-shape, not both")
    out_path = getattr(args, "out", None)
    if out_path and not Path(out_path).parent.is_dir():
        raise InvalidRequestError(f"--out {out_path}: the folder {Path(out_path).parent} does not exist")
    report = {"meta": _meta(args, s), "results": [], "profiles": {}}
    bw = copy_bandwidth(s.device)
    report["meta"]["copy_bandwidth_GBps"] = bw / 1e9
    if s.hf_dtype:
        print(f"transformers runs in {s.hf_dtype}, sparrow in {s.dtype}")
    from sparrow.random_gguf import describe, is_recipe

    quant = (f", sparrow's weights {describe(s.quantization)}" if is_recipe(s.quantization) else
             f", sparrow's weights quantized to {s.quantization} at load") if s.quantization else ""
    quant += ", LM head in FP8" if s.quantize_lm_head else ""
    quant += f", {s.kv_cache_dtype} KV cache" if s.kv_cache_dtype != "auto" else ""
    print(f"sparrow bench on {report['meta']['device_name']} ({s.device}, {s.dtype}{quant}); load average "
          f"{report['meta']['load_average_start'][0]:.2f}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)",
          flush=True)
    engine_kw = engine_kwargs(s, args.max_model_len)
    with_hf = not args.no_hf
    if args.model_shape:
        runners = shape_runners(args.model_shape, s, engine_kw, with_hf, report["meta"])
    else:
        from sparrow.default_model import default_model_path

        path = Path(args.model).expanduser() if args.model else default_model_path()
        report["meta"]["model"] = str(path)
        runners = path_runners(path, s, engine_kw, with_hf, report["meta"])
    gen = torch.Generator().manual_seed(s.seed)
    failed = False
    for runner, fp, vocab in runners:
        key = "hf_bytes_model" if isinstance(runner, HFRunner) else "bytes_model"  # each engine's own weights
        report["meta"][key] = {"weight_bytes": fp.weight_bytes, "num_experts": fp.num_experts, "top_k": fp.top_k,
                               "tied_lm_head": fp.tied}
        if isinstance(runner, HFRunner):
            report["meta"]["hf_attn_implementation"] = getattr(runner.model.config, "_attn_implementation", None)
        for p in s.prompt_lens:
            for b in s.batch_sizes:
                try:
                    row = measure(runner, s, b, p, vocab, fp, bw, gen)
                except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                    failed = True
                    row = {"engine": runner.name, "batch": b, "prompt_len": p,
                           "error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
                    _free(s.device)
                print(_progress(row), flush=True)
                report["results"].append(row)
                _write_json(out_path, report)
        if getattr(args, "profile", False):
            text = profile_step(runner, random_prompts(getattr(args, "profile_batch", 1), s.prompt_lens[0], vocab, gen),
                                s.device)
            print(text, flush=True)
            report["profiles"][runner.name] = text
        if getattr(args, "profile_prefill", False) and isinstance(runner, SparrowRunner):
            prompts = random_prompts(max(s.batch_sizes), max(s.prompt_lens), vocab, gen)
            text = profile_prefill(runner, prompts, s.device)
            print(text, flush=True)
            report["profiles"][runner.name + " prefill"] = text
        runner = None  # noqa: F841  (drop the model before the next one is built)
    report["meta"]["load_average_end"] = os.getloadavg()
    print()
    print(format_table(report["results"]))
    print(f"(bytes/step: weights touched + KV read at the mean decode context; bound = bytes / "
          f"{bw / 1e9:.1f} GB/s; load average at the end {report['meta']['load_average_end'][0]:.2f})")
    _write_json(out_path, report)
    if out_path:
        print(f"wrote {out_path}", file=sys.stderr)
    return 1 if failed else 0
