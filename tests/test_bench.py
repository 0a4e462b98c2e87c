"""Smoke tests of ``sparrow bench`` on CPU: tiny random-weight shapes, tiny sizes. They check that the table
and the JSON carry every figure with a positive value, not how fast anything is."""
from __future__ import annotations

import json

import pytest
import torch

from sparrow.bench import Footprint
from sparrow.cli import main
from sparrow.model_shapes import SHAPES, full_config_dict, hf_config, shape_config
from sparrow.models.registry import supported_architectures

FIELDS = ("ttft_s", "prefill_tok_s", "decode_step_s", "decode_tok_s_per_seq", "decode_tok_s", "bytes_per_step",
          "bound_step_s", "pct_of_bound")


def _supported(shape: str) -> bool:
    return SHAPES[shape]["architectures"][0] in supported_architectures()


def _bench(tmp_path, *extra) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--batch-sizes", "1,3", "--prompt-len", "9", "--decode-tokens", "4",
               "--out", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_is_a_valid_transformers_config(name):
    cfg = hf_config(shape_config(name))
    assert cfg.hidden_size == SHAPES[name]["hidden_size"]
    assert cfg.num_hidden_layers == SHAPES[name]["num_hidden_layers"]
    if _supported(name):
        from sparrow.config import ModelConfig

        assert ModelConfig.from_hf(full_config_dict(shape_config(name))).hidden_size == cfg.hidden_size


def test_expert_hit_fraction():
    fp = Footprint({"experts": 1000}, num_experts=128, top_k=8)
    assert fp.expert_hit_fraction(1) == pytest.approx(8 / 128)
    assert fp.expert_hit_fraction(8) == pytest.approx(1 - (120 / 128) ** 8)
    assert fp.expert_hit_fraction(10_000) == pytest.approx(1.0)
    assert Footprint({"dense": 10}).expert_hit_fraction(4) == 0.0


def test_kv_bytes_respect_the_sliding_window():
    fp = Footprint({}, kv_layers=[(2, 4, 4, 8, None), (1, 8, 8, None, None)], element_size=2)
    # sliding layer reads min(context, 8) tokens, the full layer all of them
    assert fp.kv_bytes(batch=3, context=100) == 3 * (2 * 8 * 8 + 1 * 16 * 100) * 2
    fp8 = Footprint({}, kv_layers=[(2, 4, 4, 8, None), (1, 8, 8, None, 1)], element_size=2)  # full layer in fp8
    assert fp8.kv_bytes(batch=3, context=100) == 3 * (2 * 8 * 8 * 2 + 1 * 16 * 100 * 1)


def test_tiny_dense_bench_table_and_json(tmp_path, capsys):
    report = _bench(tmp_path, "--model-shape", "tiny-dense", "--profile", "--profile-batch", "2", "--profile-prefill")
    rows = report["results"]
    assert {(r["engine"], r["batch"]) for r in rows} == {(e, b) for e in ("sparrow", "transformers") for b in (1, 3)}
    for r in rows:
        assert "error" not in r, r
        for f in FIELDS:
            assert r[f] > 0, (f, r)
        assert r["bytes_per_step_by_group"]["kv"] > 0
    assert report["meta"]["copy_bandwidth_GBps"] > 0
    assert report["meta"]["load_peak_memory_bytes"] > sum(report["meta"]["bytes_model"]["weight_bytes"].values())
    assert set(report["profiles"]) == {"sparrow", "transformers", "sparrow prefill"}
    assert "prefill of 3 x 9 tokens" in report["profiles"]["sparrow prefill"]
    text = capsys.readouterr().out
    assert "speedup" in text and "% of bound" in text and "one decode step at batch 2" in text


def test_tiny_moe_bench(tmp_path):
    """sparrow rows once Qwen3MoeForCausalLM is registered; until then transformers' rows alone."""
    report = _bench(tmp_path, "--model-shape", "tiny-moe")
    engines = {r["engine"] for r in report["results"]}
    assert engines == ({"sparrow", "transformers"} if _supported("tiny-moe") else {"transformers"})
    assert report["meta"]["bytes_model"]["num_experts"] == 8
    for r in report["results"]:
        assert "error" not in r, r
        by = r["bytes_per_step_by_group"]
        assert 0 < by["experts"] < report["meta"]["bytes_model"]["weight_bytes"]["experts"]
        for f in FIELDS:
            assert r[f] > 0, (f, r)


def test_no_hf_and_bad_flags(tmp_path, capsys):
    report = _bench(tmp_path, "--model-shape", "tiny-dense", "--no-hf")
    assert {r["engine"] for r in report["results"]} == {"sparrow"}
    assert main(["bench", "--model-shape", "no-such-shape", "--device", "cpu"]) == 2
    assert main(["bench", "--model-shape", "tiny-dense", "--device", "cpu", "--batch-sizes", "0"]) == 2
    assert "no-such-shape" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--decode-tokens", "0"], "--decode-tokens"),  # 0, 0 repeats and an empty list were replaced by defaults
    (["--repeats", "0"], "--repeats"),
    (["--batch-sizes", ""], "--batch-sizes"),
    (["--prompt-len", "100000"], "positions"),  # was an IndexError in RoPE after the model was built
    (["--out", "/nonexistent-folder/x.json"], "/nonexistent-folder"),  # was FileNotFoundError after measuring
])
def test_bad_bench_flags_are_named(flags, needle, capsys):
    assert main(["bench", "--model-shape", "tiny-moe", "--device", "cpu", "--no-hf", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparrow: error:") and "\n" not in err and needle in err, err


def test_max_model_len_above_the_shape_positions_is_allowed(tmp_path):
    """Only prompt + decode tokens must fit the shape's positions; a larger --max-model-len just sizes the pools."""
    report = _bench(tmp_path, "--model-shape", "tiny-moe", "--no-hf", "--max-model-len", "8192")
    assert report["results"] and all("error" not in r for r in report["results"])


def test_random_init_is_finite_in_bf16():
    from sparrow.model_shapes import build_random_hf_model

    model = build_random_hf_model(shape_config("tiny-gemma4"), torch.bfloat16, "cpu")
    with torch.no_grad():
        logits = model(torch.randint(4, 512, (2, 40))).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-gemma4"])
def test_sparrow_and_transformers_run_the_same_weights(name):
    """The shape path streams the random weights transformers' model is built with into sparrow: greedy ids
    agree (fp32, CPU)."""
    if not _supported(name):
        pytest.skip(f"sparrow does not register {SHAPES[name]['architectures'][0]} yet")
    from sparrow import bench
    from sparrow.model_shapes import build_random_hf_model

    s = bench.Settings(device="cpu", dtype="float32", batch_sizes=[1], prompt_lens=[20], decode_tokens=6)
    hf = build_random_hf_model(shape_config(name), torch.float32, "cpu")
    runner = bench.SparrowRunner(bench.sparrow_from_shape(shape_config(name), full_config_dict(shape_config(name)),
                                                          s, bench.engine_kwargs(s, None)))
    prompt = list(range(5, 25))
    step, cleanup = runner.decode_stepper([prompt])  # prefill + 2 greedy steps
    ids = []
    for _ in range(3):
        ids += [o.outputs[0].token_ids for o in step()]
    cleanup()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 20:]
    assert ids[-1] == ref.tolist()


def test_fp8_shape_bench_quantizes_at_load(tmp_path):
    """``--quantization fp8`` on a named shape: sparrow's linears become e4m3, so a step reads fewer bytes;
    transformers' rows (its bf16 copy of the same weights) keep the bytes of its own weights."""
    base = _bench(tmp_path, "--model-shape", "tiny-moe", "--no-hf")
    fp8 = _bench(tmp_path, "--model-shape", "tiny-moe", "--quantization", "fp8")
    for r in fp8["results"]:
        assert "error" not in r, r
        for f in FIELDS:
            assert r[f] > 0, (f, r)
    step = {(r["engine"], r["batch"]): r["bytes_per_step"] for r in fp8["results"]}
    ours = {(r["engine"], r["batch"]): r["bytes_per_step"] for r in base["results"]}
    for b in (1, 3):
        assert step["sparrow", b] < step["transformers", b] == ours["sparrow", b]
    wb, wb8 = base["meta"]["bytes_model"]["weight_bytes"], fp8["meta"]["bytes_model"]["weight_bytes"]
    assert sum(wb8.values()) < sum(wb.values())
    assert wb8["dense"] < wb["dense"]
    # --quantize-lm-head: the logits read the FP8 copy (V x H bytes + scales) instead of the bf16 LM weight
    head = _bench(tmp_path, "--model-shape", "tiny-moe", "--quantization", "fp8", "--quantize-lm-head", "--no-hf")
    wbh = head["meta"]["bytes_model"]["weight_bytes"]
    lm_bf16 = wb8["lm_head"] if "lm_head" in wb8 else wb8["embedding"]  # the model dtype's LM weight
    n = 512 * 64  # tiny-moe's vocab x hidden: one e4m3 byte each, plus the scales
    assert n <= wbh["lm_head"] < n + n // 8 < lm_bf16
    steph = {r["batch"]: r["bytes_per_step"] for r in head["results"]}
    for b in (1, 3):
        assert steph[b] == step["sparrow", b] - (lm_bf16 - wbh["lm_head"])


def test_checkpoint_transformers_cannot_load_keeps_sparrows_rows(tmp_path, monkeypatch, capsys):
    """``--model`` a checkpoint transformers cannot load (a GPTQ one without optimum, a compressed-tensors one it
    refuses): sparrow's rows are measured and written, the transformers baseline is skipped with a line naming
    transformers' error (meta ``hf_error``), not a traceback."""
    import sparrow.bench.runners as runners
    from tests.helpers import build_tiny_llama

    def refuse(path, s):
        raise ImportError("Loading a GPTQ quantized model requires optimum (`pip install optimum`)\nmore")

    monkeypatch.setattr(runners, "load_hf_pretrained", refuse)
    report = _bench(tmp_path, "--model", str(build_tiny_llama(tmp_path / "tiny")))
    assert [r["engine"] for r in report["results"]] == ["sparrow", "sparrow"]
    assert all("error" not in r for r in report["results"])
    assert report["meta"]["hf_error"] == ("ImportError: Loading a GPTQ quantized model requires optimum "
                                          "(`pip install optimum`)")
    out = capsys.readouterr().out
    assert "transformers cannot load" in out
    # peak RSS while loading: the whole process, so at least the weights it holds
    assert report["meta"]["load_peak_memory_bytes"] > sum(report["meta"]["bytes_model"]["weight_bytes"].values())
    assert "sparrow's load peaked at" in out
