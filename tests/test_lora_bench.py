"""Smoke test of benchmarks/lora.py on CPU at the tiny MoE shape: the random adapter it writes loads for the shape
(attention, dense MLP and fused-expert targets), and every batch has both tok/s figures, in the JSON as returned;
not how fast anything is."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def lora_bench():
    sys.path.insert(0, str(BENCH))
    try:
        import lora

        yield lora
    finally:
        sys.path.remove(str(BENCH))


def test_tiny_moe_lora_decode(lora_bench, tmp_path):
    out = tmp_path / "lora.json"
    rows = lora_bench.main(["--model-shape", "tiny-moe", "--device", "cpu", "--batch-sizes", "1,3", "--prompt-len",
                            "6", "--decode-tokens", "3", "--lora-rank", "4", "--num-loras", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert [(r["batch"], r["adapters"]) for r in rows] == [(1, 1), (3, 2)]
    for r in rows:
        assert r["base_tok_s"] > 0 and r["lora_tok_s"] > 0 and r["ratio"] > 0
