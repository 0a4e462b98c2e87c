"""End-to-end speculative decoding: tok/s with and without n-gram speculation on a real model (default: the
packaged Gemma 3 270M), on prompts whose replies repeat the prompt (drafts accepted) and on free text
(drafts rejected), with the mean acceptance length and a check that the greedy output is unchanged.

    python benchmarks/spec_decode.py --device cuda                        (k = 2 and 4, batches 1 and 8)
    python benchmarks/spec_decode.py --device cuda --k 4 --max-tokens 256 --out spec.json
    python benchmarks/spec_decode.py --device cpu --k 2 --batch-sizes 1 --max-tokens 16 --prompts repetitive

Configurations: plain decoding, and for each k of ``--k`` ``LLM(..., speculative_config={"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})`` (vLLM's interface, issue 24).
Each is a fresh LLM (one at a time: each sizes its KV pool from the free GPU memory). Prompt sets, 8 prompts
each, sent as user turns through the model's chat template:

- ``repetitive``: code editing (a function in the prompt, rewritten with a name changed), quoting a passage
  back word for word, continuing a numbered list in its pattern, reformatting records;
- ``free``: short stories and essays on a topic, where an n-gram proposer finds few matches and drafts are
  mostly rejected.

(The model's chat template when it has one; the packaged GGUF has none, so Gemma models get Gemma's turn
markers, other models the raw text.)

Greedy (temperature 0), ``--max-tokens`` per reply (stopping at EOS unless ``--ignore-eos``). Batch B runs a
set's 8 prompts B at a time (``--batch-sizes``; 1: one after another, 8: all at once); each point is run once untimed
(compilation at its row counts) and then timed ``--repeats`` times (the best reported). Per point: generated
tokens / wall seconds (tok/s), the speedup over plain decoding at the same point, and from the deltas of
``llm.get_metrics()`` over the timed run: drafts, draft tokens and accepted tokens
(``sparrow:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``), mean acceptance length
1 + accepted / drafts (tokens a verify step emits) and the draft acceptance rate accepted / draft tokens.
Then, per prompt, whether the speculative reply's tokens equal the plain reply's (greedy speculation must not
change them), with the first differing token where not.

Fails with a message naming the problem when this sparrow rejects ``speculative_config`` (speculative
decoding not built yet) or does not report the three metrics.
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

METRICS = ("sparrow:spec_decode_num_drafts", "sparrow:spec_decode_num_draft_tokens",
           "sparrow:spec_decode_num_accepted_tokens")

_FUNCTIONS = [
    ("total", "acc", '''def sum_positive(values):
    total = 0
    for value in values:
        if value > 0:
            total = total + value
    return total
'''),
    ("items", "entries", '''def group_by_key(items, key):
    groups = {}
    for item in items:
        name = item[key]
        if name not in groups:
            groups[name] = []
        groups[name].append(item)
    return {name: len(items) for name, items in groups.items()}
'''),
    ("line", "row", '''def parse_table(text):
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cells = [cell.strip() for cell in line.split(",")]
        rows.append(cells)
    return rows
'''),
]

_PASSAGES = [
    "The river rose slowly through the night. By morning the lower fields were under water, the fences had "
    "vanished, and the road to the village was a brown lake with the tops of the hedges showing above it. "
    "Nobody had seen a flood like it in forty years.",
    "To install the package, open a terminal and run the install command. When it finishes, start the "
    "program once to create the configuration file, then edit that file to set your user name and the folder "
    "where your data is kept. Restart the program for the changes to take effect.",
]

REPETITIVE = [
    *(f"Rewrite this Python function with the variable `{old}` renamed to `{new}`. Change nothing else and "
      f"reply with the code only.\n\n```python\n{code}```" for old, new, code in _FUNCTIONS),
    *(f"Repeat the following text exactly, word for word, and add nothing:\n\n{p}" for p in _PASSAGES),
    "Continue this list in exactly the same format up to item 15:\n1. Monday: apples, 3 kg, $4.50\n"
    "2. Tuesday: pears, 2 kg, $3.80\n3. Wednesday: plums, 4 kg, $5.20\n4. Thursday: apples, 1 kg, $1.50\n",
    "Continue this sequence of lines up to step 12:\nStep 1: move the red block to the left shelf.\n"
    "Step 2: move the blue block to the right shelf.\nStep 3: move the red block to the right shelf.\n"
    "Step 4: move the blue block to the left shelf.\n",
    "Rewrite each of these records as `name = value;`, one per line:\nwidth: 640\nheight: 480\ndepth: 24\n"
    "frames: 60\nbitrate: 8000\nchannels: 2\nsample_rate: 48000\nlatency: 12\n",
]

FREE = [
    "Write a short story about a lighthouse keeper who finds a letter in a bottle.",
    "Write a short story about a child who builds a robot out of kitchen tools.",
    "Write a short essay on why people enjoy walking in the mountains.",
    "Describe a busy market in a city you imagine, with its sounds and smells.",
    "Write a short story about a cat that travels on a train alone.",
    "Explain to a ten-year-old how rain forms, in a friendly tone.",
    "Write a short story about two friends who get lost in a forest at night.",
    "Write a letter from a sailor to his sister about his first week at sea.",
]

PROMPT_SETS = {"repetitive": REPETITIVE, "free": FREE}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a .gguf file or HF folder (default: the packaged Gemma 3 270M)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens values")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], choices=range(1, len(FREE) + 1),
                   metavar="B", help=f"1 to {len(FREE)}: a set's prompts run B at a time")
    p.add_argument("--prompts", nargs="+", default=list(PROMPT_SETS), choices=list(PROMPT_SETS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (the best is reported)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tokenizer", default=None,
                   help="a saved transformers tokenizer folder to use instead of the GGUF's (e.g. the one sparrow "
                        "converted and cached in ~/.cache/sparrow/tokenizers, carried to a machine whose "
                        "transformers converts the GGUF vocabulary differently)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile each timed run and print its N functions of most own time (host work per step)")
    p.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.k) < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--k, --max-tokens and --repeats need positive integers")
    if args.out and not args.out.parent.is_dir():
        p.error(f"--out {args.out}: the folder {args.out.parent} does not exist")
    return args


def spec_config(args, k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}


def make_llm(args, k: int | None):
    """The LLM of one configuration (k None: plain decoding). SystemExit naming the problem when
    ``speculative_config`` is not accepted."""
    from sparrow import LLM
    from sparrow.errors import InvalidRequestError

    kw = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
              enforce_eager=args.enforce_eager)
    if args.tokenizer:
        from transformers import AutoTokenizer

        kw["tokenizer"] = AutoTokenizer.from_pretrained(args.tokenizer)
    if k is None:
        return LLM(args.model, **kw)
    try:
        return LLM(args.model, speculative_config=spec_config(args, k), **kw)
    except TypeError as e:
        if "speculative_config" not in str(e):
            raise
        raise SystemExit(f"spec_decode.py: this sparrow's LLM does not take speculative_config ({e}); speculative "
                         "decoding (issue 24) is not in this tree") from None
    except InvalidRequestError as e:
        raise SystemExit(f"spec_decode.py: LLM rejected speculative_config={spec_config(args, k)}: {e}") from None


def _free(llm) -> None:
    import torch

    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spec_counters(llm) -> dict[str, int]:
    """The three speculative-decoding counters of ``llm.get_metrics()``; SystemExit when one is missing."""
    m = llm.get_metrics()
    missing = [k for k in METRICS if k not in m]
    if missing:
        raise SystemExit(f"spec_decode.py: llm.get_metrics() lacks {', '.join(missing)} (has: "
                         f"{', '.join(sorted(m))})")
    return {k: int(m[k]) for k in METRICS}


def run_point(llm, prompts: list[str], batch: int, params, spec: bool, repeats: int, profile: int = 0) -> dict:
    """Generate for ``prompts`` ``batch`` at a time: once untimed, then ``repeats`` timed runs (the fastest kept).
    Returns token ids per prompt, tokens, seconds, tok/s, engine steps and (with ``spec``) the counters' deltas
    and the decoder's average step seconds per rows-per-sequence q. ``profile`` > 0: each timed run under
    cProfile (slower), its ``profile`` functions of most own time printed."""
    def once():
        outs = []
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i:i + batch], params)
        return outs

    once()
    best = None
    for _ in range(repeats):
        before = spec_counters(llm) if spec else None
        steps = [0]
        engine_step = llm.engine.step

        def counted():
            steps[0] += 1
            return engine_step()

        llm.engine.step = counted
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        outs = once()
        seconds = time.perf_counter() - t0
        if prof is not None:
            import pstats

            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
        llm.engine.step = engine_step
        if best is None or seconds < best["seconds"]:
            ids = [list(o.outputs[0].token_ids) for o in outs]
            best = {"seconds": seconds, "tokens": sum(map(len, ids)), "token_ids": ids, "steps": steps[0],
                    "texts": [o.outputs[0].text for o in outs]}
            if spec:
                after = spec_counters(llm)
                best["counters"] = {k.split(":")[1]: after[k] - before[k] for k in METRICS}
                best["step_seconds"] = {f"b{b} q{q}": t for (b, q), t in sorted(llm.engine.spec.step_seconds.items())}
    best["tok_s"] = best["tokens"] / best["seconds"]
    return best


def acceptance(counters: dict) -> tuple[float | None, float | None]:
    """(mean acceptance length 1 + accepted / drafts, accepted / draft tokens); None where nothing was drafted."""
    drafts, tokens = counters["spec_decode_num_drafts"], counters["spec_decode_num_draft_tokens"]
    accepted = counters["spec_decode_num_accepted_tokens"]
    return (1 + accepted / drafts if drafts else None, accepted / tokens if tokens else None)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (the shorter length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def render(llm, text: str) -> tuple[str, str]:
    """(prompt, format): ``text`` as a user turn through the model's chat template; without a template the raw
    text (the model continues it)."""
    from sparrow.errors import InvalidRequestError
    from sparrow.tokenizer import apply_chat_template

    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None):
        try:
            return apply_chat_template(tok, [{"role": "user", "content": text}]), "chat template"
        except InvalidRequestError:
            pass
    return text, "raw text (no chat template)"


def main(argv=None) -> dict:
    from sparrow import SamplingParams

    args = parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    configs = [*args.k, None]  # speculation first: an LLM without it fails before any timing
    results, report = {}, {"meta": {"k": args.k, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                                    "batch_sizes": args.batch_sizes, "prompt_sets": args.prompts},
                           "points": [], "identical": []}
    for k in configs:
        name = "plain" if k is None else f"ngram k={k}"
        print(f"=== {name}", flush=True)
        llm = make_llm(args, k)
        report["meta"].setdefault("model", llm.model_path)
        report["meta"].setdefault("device", llm.config.device)
        report["meta"].setdefault("dtype", llm.config.dtype)
        for set_name in args.prompts:
            prompts = [render(llm, p)[0] for p in PROMPT_SETS[set_name]]
            report["meta"].setdefault("prompt_format", render(llm, "")[1])
            for batch in args.batch_sizes:
                r = run_point(llm, prompts, batch, params, k is not None, args.repeats, args.profile)
                results[name, set_name, batch] = r
                times = "" if "step_seconds" not in r else "; step ms by (batch bucket, q): " + ", ".join(
                    f"{q}: {1e3 * t:.2f}" for q, t in r["step_seconds"].items())
                print(f"{set_name:<10} batch {batch}: {r['tokens']} tokens in {r['seconds']:.2f} s, "
                      f"{r['tok_s']:.1f} tok/s, {r['steps']} steps ({1e3 * r['seconds'] / r['steps']:.2f} ms each)"
                      f"{times}", flush=True)
        _free(llm)
    print()
    print(f"{'prompts':<10} {'batch':>5} {'config':<11} | {'tok/s':>8} {'speedup':>7} | {'drafts':>6} {'accepted':>8} "
          f"{'accept len':>10} {'rate':>5} | identical")
    for set_name in args.prompts:
        for batch in args.batch_sizes:
            plain = results["plain", set_name, batch]
            for k in [None, *args.k]:
                name = "plain" if k is None else f"ngram k={k}"
                r = results[name, set_name, batch]
                point = {"prompts": set_name, "batch": batch, "config": name, "k": k, "tokens": r["tokens"],
                         "seconds": r["seconds"], "steps": r["steps"], "step_seconds": r.get("step_seconds"), "tok_s": r["tok_s"], "speedup": r["tok_s"] / plain["tok_s"]}
                same = ""
                if k is not None:
                    point.update(r["counters"])
                    point["acceptance_length"], point["draft_acceptance_rate"] = acceptance(r["counters"])
                    diffs = [first_difference(a, b) for a, b in zip(r["token_ids"], plain["token_ids"])]
                    point["identical_prompts"] = sum(d is None for d in diffs)
                    point["first_difference"] = diffs
                    same = f"{point['identical_prompts']}/{len(diffs)}"
                    for i, d in enumerate(diffs):
                        if d is not None:
                            same += f"; prompt {i} differs at token {d}"
                            report["identical"].append({"prompts": set_name, "batch": batch, "config": name,
                                                        "prompt": i, "first_difference": d,
                                                        "plain_text": plain["texts"][i], "spec_text": r["texts"][i]})
                report["points"].append(point)
                length, rate = point.get("acceptance_length"), point.get("draft_acceptance_rate")
                drafts = f"{point['spec_decode_num_drafts']:6d} {point['spec_decode_num_accepted_tokens']:8d}" \
                    if k is not None else f"{'-':>6} {'-':>8}"
                print(f"{set_name:<10} {batch:5d} {name:<11} | {r['tok_s']:8.1f} {point['speedup']:6.2f}x | {drafts} "
                      f"{f'{length:.2f}' if length else '-':>10} {f'{rate:.2f}' if rate else '-':>5} | {same}")
    differing = report["identical"]
    print(f"greedy outputs with speculation equal to plain decoding: "
          f"{'all' if not differing else f'{len(differing)} replies differ (see the JSON)'}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
