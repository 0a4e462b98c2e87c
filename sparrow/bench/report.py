"""The printed table, the progress lines and the JSON report."""
from __future__ import annotations

import json
from pathlib import Path


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
