"""Multi-LoRA decode speed: tok/s of batches whose requests run different LoRA adapters, against the same batches
on the engine without LoRA, on a random-weight model of a named shape.

    python benchmarks/lora.py --model-shape gemma4-26b-a4b --quantization fp8 --lora-rank 16 --num-loras 8
    python benchmarks/lora.py --model-shape tiny-moe --device cpu --batch-sizes 1,2 --prompt-len 8 \\
        --decode-tokens 4 --lora-rank 4 --num-loras 2                                  (CPU smoke run)

The model is built as ``sparrow bench --model-shape NAME`` builds it (transformers' random init, copied into
sparrow's model, ``--quantization`` at load). One random PEFT adapter of rank ``--lora-rank`` is written for the
shape (lora_A / lora_B on every q / k / v / o and dense gate / up / down projection, and PEFT target_parameters
on the fused expert tensors ``experts.gate_up_proj`` / ``experts.down_proj``), and ``--num-loras`` LoRARequests
with distinct ids name it: the engine holds each in its own slot, as it would distinct adapters.

Per batch size B: an engine without LoRA, then one with ``enable_lora=True, max_loras=--num-loras,
max_lora_rank=--lora-rank`` on the same weights, each: a warm-up run, then B random prompts of ``--prompt-len``
tokens generating ``--decode-tokens`` tokens each (greedy, ignore_eos); decode tok/s = tokens generated after
every sequence has its first token / the time since then (CUDA graphs and overlapped decode as in serving). With
LoRA, request i runs adapter i mod num-loras (batch 1: one adapter). Targets (issue 26): >= 90 % of the no-LoRA
tok/s at batch 1, >= 85 % at batches 8 and 64 with 8 adapters. ``--out``: the rows as JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def write_random_adapter(hf_model, rank: int, folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A PEFT adapter folder for ``hf_model`` (transformers): lora_A [r, in] ~ N(0, 1/in), lora_B [out, r] ~
    N(0, 0.01^2) on every Linear named in LINEAR_TARGETS and, for fused 3-D expert tensors [E, out, in], PEFT's
    ParamWrapper factors lora_A [E r, in], lora_B [out, E r]; alpha = 2 r. Saved in the model's dtype."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    dtype = next(hf_model.parameters()).dtype
    tensors, modules, params = {}, set(), set()

    def put(name: str, k: int, n: int, r: int) -> None:
        tensors[f"base_model.model.{name}.lora_A.weight"] = (torch.randn(r, k, generator=g) / k**0.5).to(dtype)
        tensors[f"base_model.model.{name}.lora_B.weight"] = (torch.randn(n, r, generator=g) * 0.01).to(dtype)

    for name, m in hf_model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(m, torch.nn.Linear) and leaf in LINEAR_TARGETS and ".experts." not in name:
            put(name, m.in_features, m.out_features, rank)
            modules.add(leaf)
    for name, p in hf_model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if p.dim() == 3 and module.endswith("experts") and leaf in EXPERT_TENSORS:
            e, n, k = p.shape
            put(module + (".base_layer" if leaf == "gate_up_proj" else ""), k, n, e * rank)  # nested wrappers
            params.add(f"experts.{leaf}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(modules),
        "target_parameters": sorted(params), "bias": "none", "use_dora": False, "use_rslora": False}))
    return folder


def decode_tok_s(engine, prompts: list[list[int]], new_tokens: int, loras: list) -> float:
    """Decode tok/s of one run of ``prompts`` (request i with ``loras[i]``): tokens after every sequence has its
    first token / seconds since then."""
    from sparrow import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rids = [engine.add_request({"prompt_token_ids": p}, params, lora_request=lr) for p, lr in zip(prompts, loras)]
    counts = dict.fromkeys(rids, 0)
    t_first, after, now = None, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        new = 0
        for o in outs:
            c = len(o.outputs[0].token_ids)
            new, counts[o.request_id] = new + c - counts[o.request_id], c
        if t_first is not None:
            after += new
        elif all(counts.values()):
            t_first = now
    return after / (now - t_first) if t_first is not None and now > t_first else 0.0


def profile_decode(engine, prompts: list[list[int]], loras: list, device: str, rows: int) -> str:
    """torch.profiler table of 4 decode steps of ``prompts`` (request i with ``loras[i]``), after every request's
    prefill: the ``rows`` ops of most self device time (CUDA) or self CPU time, with the steps' wall time."""
    from torch.profiler import ProfilerActivity, profile

    from sparrow import SamplingParams
    from sparrow.bench.timing import _table

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rids = [engine.add_request({"prompt_token_ids": p}, params, lora_request=lr) for p, lr in zip(prompts, loras)]
    cuda = device.startswith("cuda")
    engine.step()  # the prefill
    engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(4):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for rid in rids:
        engine.abort(rid)
    return f"4 decode steps at batch {len(prompts)} with LoRA: {wall * 1e3 / 4:.2f} ms each\n{_table(prof, cuda, rows)}"


def _engine(model, device: str, dtype: str, batch: int, max_model_len: int, lora: dict | None):
    from sparrow.llm import LLM

    kw = dict(max_model_len=max_model_len, max_num_seqs=batch, enable_prefix_caching=False,
              num_kv_blocks=batch * -(-max_model_len // 16) + batch, max_num_batched_tokens=max(2048, max_model_len))
    return LLM.from_model(model, device=device, dtype=dtype, **kw, **(lora or {})).engine


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="gemma4-26b-a4b")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (quantized at load)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--num-loras", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each LoRA point, a torch.profiler table of 4 decode steps: its N ops of most self "
                        "device time (CPU time on a CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from sparrow.bench.runners import sparrow_model_random
    from sparrow.config import TORCH_DTYPES
    from sparrow.lora.request import LoRARequest
    from sparrow.model_shapes import full_config_dict, hf_skeleton, shape_config

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cfg = shape_config(args.model_shape)
    full = full_config_dict(cfg)
    print(f"building random-weight {args.model_shape} ({dtype}, {args.quantization or 'unquantized'}) on "
          f"{args.device} ...", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="sparrow-lora-bench-")
    folder = write_random_adapter(hf_skeleton(cfg, TORCH_DTYPES[dtype]), args.lora_rank,  # names and shapes
                                  pathlib.Path(tmp.name) / "adapter", args.seed)
    settings = SimpleNamespace(quantization=args.quantization, dtype=dtype, device=args.device,
                               quantize_lm_head=False, seed=args.seed)
    model = sparrow_model_random(cfg, full, settings)  # streamed: the float model never exists whole
    _free(args.device)
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(folder)) for i in range(args.num_loras)]
    max_len = args.prompt_len + args.decode_tokens
    gen = torch.Generator().manual_seed(args.seed)
    vocab = int(full["vocab_size"])
    rows, loaded = [], {}
    for b in batches:
        prompts = torch.randint(4, vocab, (b, args.prompt_len), generator=gen).tolist()
        adapters = requests[:1] if b == 1 else requests
        loras = [adapters[i % len(adapters)] for i in range(b)]
        row = {"batch": b, "adapters": len(set(loras))}
        for key, lora, lr in (("base_tok_s", None, [None] * b),
                              ("lora_tok_s", dict(enable_lora=True, max_loras=args.num_loras,
                                                  max_lora_rank=args.lora_rank), loras)):
            engine = _engine(model, args.device, dtype, b, max_len, lora)
            if engine.runner.lora is not None:  # the host copies read by an earlier engine on the same model
                engine.runner.lora.adapters.update(loaded.get("adapters", {}))
                engine.runner.lora.folders.update(loaded.get("folders", {}))
                loaded = {"adapters": engine.runner.lora.adapters, "folders": engine.runner.lora.folders}
            decode_tok_s(engine, prompts, min(8, args.decode_tokens), lr)  # warm-up: slots filled, kernels built
            row[key] = decode_tok_s(engine, prompts, args.decode_tokens, lr)
            if args.profile and lora is not None:
                print(profile_decode(engine, prompts, lr, args.device, args.profile), flush=True)
            del engine
            for m in model.modules():  # drop the slot buffers with the engine that made them
                m.__dict__.pop("lora", None)
            _free(args.device)
        row["ratio"] = row["lora_tok_s"] / row["base_tok_s"] if row["base_tok_s"] else 0.0
        row["target"] = 0.90 if b == 1 else 0.85
        rows.append(row)
        print(f"batch {b:>3}: {row['adapters']} adapter(s) of rank {args.lora_rank}: no LoRA "
              f"{row['base_tok_s']:9.1f} tok/s, LoRA {row['lora_tok_s']:9.1f} tok/s = {100 * row['ratio']:5.1f} % "
              f"(target >= {100 * row['target']:.0f} %)", flush=True)
    tmp.cleanup()
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"meta": vars(args), "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
