"""``sparrow bench``: prefill and decode speed of sparrow and of HF transformers on the same weights, in one
run, against the memory-bandwidth bound (design.md §5).

For each (batch B, prompt length P) one greedy run of N new tokens per sequence is timed per step (sparrow:
engine steps; transformers: a streamer in ``generate``). TTFT = time until every sequence has its first
token (that run's "max_tokens=1" part); decode tok/s = tokens after that / the time they took. Bytes read per
decode step = non-expert weights + LM head + the experts B rows are expected to touch + the KV cache at the
mean decode context; % of bound = (bytes / copy bandwidth) / step time, with the copy bandwidth measured at
the start of the same run. ``ignore_eos`` (HF: min_new_tokens = max_new_tokens), fresh random prompts per
run (no prefix-cache hits). See benchmarks/README.md.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from sparrow.errors import InvalidRequestError, UnsupportedArchitectureError

from sparrow.config import TORCH_DTYPES as _DTYPES
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k")


@dataclass
class Settings:
    """The resolved benchmark settings."""

    device: str
    dtype: str
    batch_sizes: list[int]
    prompt_lens: list[int]
    decode_tokens: int
    repeats: int = 1
    seed: int = 0
    enforce_eager: bool = False
    quantization: str | None = None
    hf_dtype: str | None = None
    """transformers' dtype when it differs from sparrow's (--hf-dtype, checkpoints only); None: the same."""

    @property
    def max_model_len(self) -> int:
        """Longest sequence a run needs (+1 spare position)."""
        return max(self.prompt_lens) + self.decode_tokens + 1


@dataclass
class Footprint:
    """What one decode step must read, apart from activations (bytes)."""

    weight_bytes: dict[str, int]
    """Parameter bytes by group: 'dense' (every step reads it), 'lm_head', 'embedding' (a step gathers B rows;
    when tied it is the LM head, read whole), 'experts' (all of them; scaled by the hit fraction per step)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token."""
    tied: bool = False
    """The LM head is the embedding table."""
    hidden: int = 0
    """Hidden size (bytes of an embedding row = hidden x element size)."""
    kv_layers: list[tuple[int, int, int, int | None]] = field(default_factory=list)
    """Per attention layer: (KV heads, K head dim, V head dim, sliding window or None)."""
    element_size: int = 2
    """Bytes per element of weights / KV cache."""

    def expert_hit_fraction(self, batch: int) -> float:
        """Expected fraction of a layer's experts that B tokens with uniform top-k routing touch:
        1 - (1 - k/E)^B (each expert is missed by one token with probability 1 - k/E)."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch

    def kv_bytes(self, batch: int, context: float) -> float:
        """K and V bytes a decode step reads for ``batch`` sequences at ``context`` tokens each."""
        per_seq = sum(h * (dk + dv) * min(context, w or context) for h, dk, dv, w in self.kv_layers)
        return batch * per_seq * self.element_size

    def step_bytes(self, batch: int, context: float) -> dict[str, float]:
        """Bytes read by one decode step of ``batch`` sequences, by group, plus 'total'."""
        w = self.weight_bytes
        lm_head = w.get("embedding", 0) if self.tied else w.get("lm_head", 0)
        out = {"dense": float(w.get("dense", 0)), "lm_head": float(lm_head),
               "experts": w.get("experts", 0) * self.expert_hit_fraction(batch),
               "embedding": float(batch * self.hidden * self.element_size),  # the rows gathered
               "kv": self.kv_bytes(batch, context)}
        out["total"] = sum(out.values())
        return out


def _first(cfg: dict, keys, default=0):
    for k in keys:
        if cfg.get(k):
            return cfg[k]
    return default


def footprint(model: torch.nn.Module, cfg: dict, tied: bool, hidden: int) -> Footprint:
    """Group ``model``'s parameters (sparrow's or transformers') for the bytes-per-step model; ``cfg`` is
    the HF config dict (expert count and top-k)."""
    n_exp, top_k = int(_first(cfg, _EXPERT_COUNT_KEYS)), int(_first(cfg, _TOP_K_KEYS))
    groups: dict[str, int] = {}
    elt = 2
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if "weight" in n.rsplit(".", 1)[-1]]  # quantized weights
    for name, p in tensors:
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            group, elt = "embedding", p.element_size()
        elif name.startswith("lm_head"):
            group = "lm_head"
        elif n_exp and ".experts." in name and p.dim() >= 3 and p.shape[0] == n_exp:
            group = "experts"
        else:
            group = "dense"
        groups[group] = groups.get(group, 0) + nbytes
    return Footprint(groups, n_exp, top_k, tied, hidden, _kv_layers(model), elt)


def _kv_layers(model) -> list[tuple[int, int, int, int | None]]:
    """(KV heads, K dim, V dim, window) per attention layer: sparrow's Attention modules, or transformers'
    attention modules (those with k_proj and head_dim)."""
    if hasattr(model, "attention_layers"):
        return [(a.num_kv_heads, a.head_dim, a.v_head_dim, a.sliding_window) for a in model.attention_layers()]
    out = []
    for mod in model.modules():
        k_proj, d = getattr(mod, "k_proj", None), getattr(mod, "head_dim", None)
        if k_proj is not None and d:
            out.append((k_proj.out_features // d, d, d, getattr(mod, "sliding_window", None)))
    return out


# ---------------------------------------------------------------------------------------------- timing


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

    def decode_stepper(self, prompt: list[int]):
        """(one decode step of batch 1, cleanup): the prompt is prefilled and two steps are warmed first."""
        from sparrow.sampling_params import SamplingParams

        eng = self.engine
        rid = eng.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        produced = 0
        while produced < 3:  # prefill (maybe several chunks) + two decode steps
            produced = max([len(o.outputs[0].token_ids) for o in eng.step()] or [produced])
        return eng.step, lambda: eng.abort(rid)


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
    def decode_stepper(self, prompt: list[int]):
        """(one decode step of batch 1 with the KV cache, cleanup)."""
        out = self.model(input_ids=torch.tensor([prompt], device=self.device), use_cache=True)
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
    """One row of the table: times in seconds, rates in tokens/s, bytes per decode step. A short warm-up
    run first (CUDA graphs, autotuning, allocator); then ``s.repeats`` timed runs, the best reported (other
    work on the machine only ever slows a run down)."""
    n = s.decode_tokens
    runner.run(random_prompts(batch, prompt_len, vocab, gen), 2)
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


def profile_step(runner, prompt: list[int], device: str, rows: int = 20) -> str:
    """torch.profiler table of one batch-1 decode step: the top ``rows`` ops by self device time (CUDA)
    or self CPU time (CPU), with the step's wall time on top."""
    from torch.profiler import ProfilerActivity, profile

    step, cleanup = runner.decode_stepper(prompt)
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        wall = _timed(step, device)
        with profile(activities=acts) as prof:
            step()
            _sync(device)
    finally:
        cleanup()
    avg = prof.key_averages()
    for key in (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:
            table = avg.table(sort_by=key, row_limit=rows)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    return f"{runner.name}: one decode step at batch 1, prompt {len(prompt)}: {wall * 1e3:.2f} ms wall\n{table}"


# ---------------------------------------------------------------------------------------------- models


def engine_from_model(model: torch.nn.Module, model_config, s: Settings, **engine_kw):
    """sparrow's ``Engine`` around an already-built model (what ``LLM`` does after loading from a path;
    LLM has no constructor for a built model). ``engine_kw``: LLM's engine arguments (max_model_len,
    num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enforce_eager)."""
    from sparrow.config import CacheConfig, EngineConfig, SchedulerConfig
    from sparrow.engine.engine import Engine

    config = EngineConfig(
        model=model_config, device=s.device, dtype=s.dtype, max_model_len=engine_kw["max_model_len"],
        cache=CacheConfig(block_size=engine_kw.get("block_size", 16), num_blocks=engine_kw["num_kv_blocks"],
                          enable_prefix_caching=engine_kw["enable_prefix_caching"]),
        scheduler=SchedulerConfig(max_num_seqs=engine_kw["max_num_seqs"],
                                  max_num_batched_tokens=engine_kw["max_num_batched_tokens"]),
        enforce_eager=engine_kw["enforce_eager"],
    )
    return Engine(config, model, tokenizer=None)


def engine_kwargs(s: Settings, max_model_len: int | None) -> dict:
    """LLM arguments for the benchmark: a KV pool that holds every sequence of the largest batch at once,
    no prefix caching (each run uses fresh prompts anyway), a step budget that prefills one prompt whole."""
    mml = max_model_len or s.max_model_len
    if mml < s.max_model_len:
        raise InvalidRequestError(f"--max-model-len {mml} is shorter than prompt + decode tokens ({s.max_model_len})")
    block, top = 16, max(s.batch_sizes)
    return dict(max_model_len=mml, num_kv_blocks=top * -(-mml // block) + top, max_num_seqs=max(top, 1),
                max_num_batched_tokens=max(8192 if s.device.startswith("cuda") else 2048, max(s.prompt_lens)),
                enable_prefix_caching=False, enforce_eager=s.enforce_eager, skip_tokenizer_init=True)


def sparrow_from_hf(hf_model, full_cfg: dict, s: Settings, engine_kw: dict):
    """sparrow's model for ``full_cfg`` on the device, filled from the transformers model's state dict (the
    same weights), wrapped in an Engine. Raises UnsupportedArchitectureError if sparrow lacks the architecture."""
    from sparrow.config import ModelConfig
    from sparrow.loader.model_loader import build_model, finish_loading
    from sparrow.loader.weights import load_weights
    from sparrow.models.registry import get_model_class

    mcfg = ModelConfig.from_hf(full_cfg)
    quant_config = None
    if s.quantization:  # on-load quantization of the random bf16 weights (the CLI allows only "fp8")
        from sparrow.quant.fp8 import Fp8Config

        quant_config = Fp8Config(from_checkpoint=False)
    model = build_model(get_model_class(mcfg.architecture), mcfg, _DTYPES[s.dtype], s.device, quant_config)
    load_weights(model, hf_model.state_dict().items())
    finish_loading(model, quant_config)
    kw = {k: v for k, v in engine_kw.items() if k != "skip_tokenizer_init"}
    return engine_from_model(model, mcfg, s, **kw)


def load_hf_pretrained(path: Path, s: Settings):
    """transformers' model from a .gguf file (dequantized to the dtype) or an HF folder, on the device."""
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[s.hf_dtype or s.dtype]
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(s.device).eval()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shape_runners(name: str, s: Settings, engine_kw: dict, with_hf: bool, meta: dict):
    """Yield (runner, footprint, vocab) for sparrow, then transformers, on one random-weight model of a
    named shape. transformers' model is built first (random init on the device) and sparrow's is filled
    from it; when the weights would not fit twice beside the KV pools (> 1/4 of GPU memory) the HF copy
    waits in host memory while sparrow runs, and sparrow is freed before HF runs."""
    from sparrow.model_shapes import build_random_hf_model, full_config_dict, shape_config

    cfg = shape_config(name)
    full = full_config_dict(cfg)
    tied, hidden, vocab = bool(full.get("tie_word_embeddings")), int(full["hidden_size"]), int(full["vocab_size"])
    print(f"building random-weight {name} ({s.dtype}) on {s.device} ...", flush=True)
    hf = build_random_hf_model(cfg, _DTYPES[s.dtype], s.device, seed=s.seed)
    meta["params"] = sum(p.numel() for p in hf.parameters())
    fp = footprint(hf, full, tied, hidden)
    try:
        engine = sparrow_from_hf(hf, full, s, engine_kw)
    except UnsupportedArchitectureError as e:
        print(f"sparrow cannot run {name} yet ({e}); measuring transformers only", flush=True)
        meta["sparrow_error"] = str(e)
        engine = None
    cuda = s.device.startswith("cuda")
    park = engine is not None and cuda and _param_bytes(hf) > 0.25 * torch.cuda.get_device_properties(torch.device(s.device)).total_memory
    if park:
        print("weights too large to hold twice: transformers' copy waits in host memory", flush=True)
        hf.to("cpu")
        _free(s.device)
    if engine is not None:
        fp = footprint(engine.runner.model, full, tied, hidden)
        yield SparrowRunner(engine), fp, vocab
        del engine
        _free(s.device)
    if with_hf:
        if park:
            hf.to(s.device)
        yield HFRunner(hf, s.device), fp, vocab


def path_runners(path: Path, s: Settings, engine_kw: dict, with_hf: bool, meta: dict):
    """Yield (runner, footprint, vocab) for sparrow's LLM on a checkpoint, then (after freeing it) for
    transformers' model loaded from the same file."""
    from sparrow.engine.llm import LLM

    print(f"loading {path} with sparrow ({s.dtype}, {s.device}) ...", flush=True)
    quant = {"quantization": s.quantization} if s.quantization else {}
    engine = LLM(str(path), device=s.device, dtype=s.dtype, **quant, **engine_kw).engine
    mcfg = engine.config.model
    fp = footprint(engine.runner.model, mcfg.raw, mcfg.tie_word_embeddings, mcfg.hidden_size)
    meta["params"] = sum(p.numel() for p in engine.runner.model.parameters())
    yield SparrowRunner(engine), fp, mcfg.vocab_size
    del engine
    _free(s.device)
    if with_hf:
        print(f"loading {path} with transformers ...", flush=True)
        yield HFRunner(load_hf_pretrained(path, s), s.device), fp, mcfg.vocab_size


# ---------------------------------------------------------------------------------------------- report

_COLUMNS = [("engine", "engine", "{}"), ("batch", "batch", "{}"), ("prompt", "prompt_len", "{}"),
            ("TTFT ms", "ttft_s", "{:.1f}"), ("prefill tok/s", "prefill_tok_s", "{:.0f}"),
            ("decode tok/s/seq", "decode_tok_s_per_seq", "{:.1f}"), ("decode tok/s", "decode_tok_s", "{:.1f}"),
            ("step ms", "decode_step_s", "{:.2f}"), ("MB/step", "bytes_per_step", "{:.1f}"),
            ("bound ms", "bound_step_s", "{:.3f}"), ("% of bound", "pct_of_bound", "{:.1f}")]
_SCALE = {"ttft_s": 1e3, "decode_step_s": 1e3, "bound_step_s": 1e3, "bytes_per_step": 1e-6}
# speedup of sparrow over transformers: throughputs divide sparrow/HF, times HF/sparrow
_SPEEDUP = {"ttft_s": -1, "prefill_tok_s": 1, "decode_tok_s_per_seq": 1, "decode_tok_s": 1, "decode_step_s": -1}


def _cell(row: dict, key: str, fmt: str) -> str:
    if key not in row:
        return row.get("error", "-")[:40] if key == "ttft_s" else ""
    v = row[key]
    return fmt.format(v * _SCALE.get(key, 1) if isinstance(v, float) else v)


def format_table(rows: list[dict]) -> str:
    """The results as an aligned text table; after each (batch, prompt) pair measured by both engines a
    'speedup' row gives sparrow / transformers (times: transformers / sparrow)."""
    lines = [[h for h, _, _ in _COLUMNS]]
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key.setdefault((r["batch"], r["prompt_len"]), {})[r["engine"]] = r
    for (b, p), pair in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for r in pair.values():
            lines.append([_cell(r, k, f) for _, k, f in _COLUMNS])
        sp, hf = pair.get("sparrow", {}), pair.get("transformers", {})
        if "ttft_s" in sp and "ttft_s" in hf:
            cells = ["speedup", str(b), str(p)]
            for _, k, _f in _COLUMNS[3:]:
                sign = _SPEEDUP.get(k)
                cells.append("" if sign is None else f"{(sp[k] / hf[k]) ** sign:.2f}x")
            lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def _progress(r: dict) -> str:
    head = f"[{r['engine']}] batch {r['batch']}, prompt {r['prompt_len']}:"
    if "error" in r:
        return f"{head} FAILED: {r['error']}"
    return (f"{head} TTFT {r['ttft_s'] * 1e3:.1f} ms ({r['prefill_tok_s']:.0f} tok/s), decode "
            f"{r['decode_tok_s_per_seq']:.1f} tok/s/seq = {r['decode_tok_s']:.1f} tok/s, step "
            f"{r['decode_step_s'] * 1e3:.2f} ms, {r['bytes_per_step'] / 1e6:.1f} MB/step, "
            f"{r['pct_of_bound']:.1f}% of bound")


def _write_json(path: str | None, report: dict) -> None:
    if path:
        tmp = Path(path).with_suffix(".partial")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(path)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise InvalidRequestError(f"{flag} needs positive integers, got {text!r}")
    return out


def resolve_settings(args) -> Settings:
    """Settings from the CLI flags; unset sizes default by device (GPU: batches 1,8,64, prompts 128,2048,
    64 new tokens; CPU: batches 1,8, prompt 128, 32 new tokens)."""
    from sparrow.engine.llm import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    gpu = device.startswith("cuda")
    s = Settings(
        device=device, dtype=resolve_dtype(args.dtype, device),
        batch_sizes=_int_list(args.batch_sizes or ("1,8,64" if gpu else "1,8"), "--batch-sizes"),
        prompt_lens=_int_list(args.prompt_len or ("128,2048" if gpu else "128"), "--prompt-len"),
        decode_tokens=args.decode_tokens or (64 if gpu else 32),
        repeats=getattr(args, "repeats", 1) or 1, seed=getattr(args, "seed", 0) or 0,
        enforce_eager=bool(getattr(args, "enforce_eager", False)), quantization=getattr(args, "quantization", None),
        hf_dtype=resolve_dtype(args.hf_dtype, device) if getattr(args, "hf_dtype", None) else None,
    )
    if s.hf_dtype and args.model_shape:
        raise InvalidRequestError("--hf-dtype works with --model only (a random-weight shape is shared in one dtype)")
    if s.decode_tokens < 2:
        raise InvalidRequestError("--decode-tokens must be at least 2 (decode speed needs a second token)")
    return s


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
    report = {"meta": _meta(args, s), "results": [], "profiles": {}}
    bw = copy_bandwidth(s.device)
    report["meta"]["copy_bandwidth_GBps"] = bw / 1e9
    if s.hf_dtype:
        print(f"transformers runs in {s.hf_dtype}, sparrow in {s.dtype}")
    print(f"sparrow bench on {report['meta']['device_name']} ({s.device}, {s.dtype}); load average "
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
        report["meta"]["bytes_model"] = {"weight_bytes": fp.weight_bytes, "num_experts": fp.num_experts,
                                         "top_k": fp.top_k, "tied_lm_head": fp.tied}
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
            text = profile_step(runner, random_prompts(1, s.prompt_lens[0], vocab, gen)[0], s.device)
            print(text, flush=True)
            report["profiles"][runner.name] = text
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
