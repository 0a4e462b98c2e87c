"""benchmarks/serve.py end to end on the smallest shape on the CPU: it starts `sparrow serve` itself, runs the
served and the in-process load, and writes every figure to its JSON."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_benchmark_smoke(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--model-shape", "tiny-dense", "--device", "cpu",
         "--dtype", "float32", "--streams", "1,2", "--prompt-len", "8", "--max-tokens", "4",
         "--requests-per-stream", "2", "--min-requests", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [p["streams"] for p in report["points"]] == [1, 2]
    for p in report["points"]:
        for side in ("served", "in_process"):
            r = p[side]
            assert r["requests"] == 2 * p["streams"] and r["output_tokens"] == 4 * r["requests"]
            for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "wall_s"):
                assert math.isfinite(r[key]) and r[key] > 0, (side, key, r)
            # 0 when a request's tokens all came in its first chunk (the server merged what a slow reader missed)
            assert math.isfinite(r["tpot_p50_ms"]) and r["tpot_p50_ms"] >= 0, (side, r)
            assert r["requests"] <= r["chunks"] <= r["output_tokens"]
            if r["chunks"] > r["requests"]:  # some request came in several chunks: gaps between them were timed
                assert math.isfinite(r["itl_p50_ms"]) and r["itl_p99_ms"] >= r["itl_p50_ms"] > 0, (side, r)
            else:  # the server merged each request's later steps into one chunk: no gap to time
                assert math.isnan(r["itl_p50_ms"]), (side, r)
        served = p["served"]
        assert served["client_procs"] == 1 and 0 < served["client_cpu_max"]
        # the server's own TTFT (its /metrics histogram over the point's requests) is part of the client's
        assert 0 < served["server_time_to_first_token_mean_ms"] <= served["ttft_p99_ms"] + 1.0, served
        assert served["server_e2e_request_latency_mean_ms"] >= served["server_time_to_first_token_mean_ms"]
        # engine steps by kind, on both sides: every request's prefill ran in some prefill step
        assert served["server_engine_step_prefill_count"] >= 1 and served["server_engine_step_prefill_mean_ms"] > 0
        assert p["in_process"]["engine_step_prefill_count"] >= 1
        assert p["in_process"]["engine_step_decode_count"] >= 1
        assert p["ratio_tok_s"] > 0 and math.isfinite(p["added_ttft_p50_ms"]) and isinstance(p["meets_target"], bool)
    assert "served" in proc.stdout and "in-process" in proc.stdout
