"""Smoke test of benchmarks/verify_step.py on CPU at the tiny Gemma 4 shape: every (batch, q) step and every
(kernel, rows) entry is there with positive figures, in the JSON as returned; not how fast anything is."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def verify_step():
    sys.path.insert(0, str(BENCH))
    try:
        import verify_step

        yield verify_step
    finally:
        sys.path.remove(str(BENCH))


def test_tiny_gemma4_verify_steps_and_kernels(verify_step, tmp_path, capsys):
    out = tmp_path / "verify.json"
    report = verify_step.main(["--device", "cpu", "--model-shape", "tiny-gemma4", "--batch-sizes", "1", "2",
                               "--q", "2", "3", "--context", "20", "--steps", "2", "--warmup", "1",
                               "--kernel-rows", "1", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    steps = report["steps"]
    assert [(r["batch"], r["q"]) for r in steps] == [(b, q) for b in (1, 2) for q in (1, 2, 3)]  # q=1 added
    for r in steps:
        assert r["rows"] == r["batch"] * r["q"] and r["draft_tokens"] == r["q"] - 1
        for key in ("step_us", "bytes_per_step", "bound_us", "step_x_q1", "bound_x_q1", "pct_of_bound"):
            assert r[key] > 0, (key, r)
        assert r["graph_us"] is None and not r["cuda_graph"]  # CPU: eager steps
        if r["q"] == 1:
            assert r["step_x_q1"] == 1.0
    for b in (1, 2):  # more rows hit more experts (uniform routing model): the bytes grow with q
        sizes = [r["bytes_per_step_by_group"]["experts"] for r in steps if r["batch"] == b]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    kernels = {(r["kernel"], r["rows"]): r for r in report["kernels"]}
    names = ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj", "dense MLP", "MoE experts small")
    assert set(kernels) == {(n, rows) for n in names for rows in (1, 3)}
    for r in kernels.values():
        assert r["us"] > 0 and r["gbps"] > 0 and r["bytes"] > 0, r
    assert kernels["MoE experts small", 3]["pairs"] == 3 * report["meta"]["top_k"]
    text = capsys.readouterr().out
    assert report["targets"] == []  # the target line needs q = 5, not asked here
    assert "x q=1" in text and "MoE experts small" in text
