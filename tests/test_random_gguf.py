"""Random-block GGUF models of named shapes (``sparrow.random_gguf``, ``model_shapes.random_model`` with
``quantization="gguf-q4_k_m" | "gguf-q8_0"``) on the CPU, at tiny configs whose rows hold K-quant blocks (K a
multiple of 256; the tiny shapes' hidden 64 would send every Q4_K to its Q5_0 fallback).

The expected types are written out here from llama.cpp src/llama-quant.cpp (``llama_tensor_get_type_impl``'s
Q4_K_M rules, ``use_more_bits``, ``tensor_type_fallback``), not computed by the module; the oracle of the outputs is
the same model in float with every block dequantized by ``gguf_blocks.dequantize`` (bit-exact with gguf-py); the
bytes a bench step reads are summed here from the shapes and gguf-py's block sizes.
"""
from __future__ import annotations

import json

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from sparrow import SamplingParams
from sparrow.errors import InvalidRequestError
from sparrow.llm import LLM
from sparrow.model_shapes import SHAPES, hf_skeleton, random_gguf_weights, random_model, shape_config
from sparrow.random_gguf import STD, random_blocks

Q4, Q5_0, Q6, Q8 = T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0


def _dense() -> dict:
    """Llama, 8 layers: use_more_bits(i, 8) holds for layers 0, 3, 6, 7 (i < 1, i >= 7, (i - 1) % 3 == 2)."""
    return {**shape_config("tiny-dense"), "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 8,
            "head_dim": 64}


def _gemma4() -> dict:
    """Gemma 4, 6 layers (5 sliding, then a full one without V: K = V), 4 experts of width 96, tied embedding."""
    return {**shape_config("tiny-gemma4"), "hidden_size": 256, "intermediate_size": 256, "head_dim": 64,
            "global_head_dim": 128, "num_experts": 4, "moe_intermediate_size": 96}


def _qwen3_moe8() -> dict:
    """Qwen3-MoE with exactly 8 experts: Mixtral's rule (attn_v / attn_k Q8_0, attn_output Q5_K)."""
    return {**shape_config("tiny-moe"), "hidden_size": 256, "head_dim": 64, "moe_intermediate_size": 256}


def _want_dense(layer: int, proj: str) -> T:
    more = layer in (0, 3, 6, 7)
    return Q6 if proj in ("v_proj", "down_proj") and more else Q4


def _want_gemma4(layer: int, proj: str) -> T:
    # V projections are layers 0..4 (5 of them): use_more_bits(i, 5) for i = 2, 4 (i >= 4, i % 3 == 2);
    # down projections: use_more_bits(layer, 6) for layers 2, 5 (layer >= 5, layer % 3 == 2)
    if proj == "v_proj":
        return Q6 if layer in (2, 4) else Q4
    if proj == "down_proj":
        return Q6 if layer in (2, 5) else Q4
    if proj == "experts.down_proj":  # rows of 96: Q6_K -> Q8_0, Q4_K -> Q5_0 (tensor_type_fallback)
        return Q8 if layer in (2, 5) else Q5_0
    return Q4


def _want_moe8(layer: int, proj: str) -> T:
    more = layer == 1  # use_more_bits(i, 2): i >= 7 * 2 // 8 = 1; layer 0 is neither < 2 // 8 nor (0 - 0) % 3 == 2
    return {"v_proj": Q8, "k_proj": Q8, "o_proj": T.Q5_K}.get(proj, Q6 if proj.endswith("down_proj") and more
                                                                else Q4)


CASES = {"dense": (_dense, _want_dense), "gemma4": (_gemma4, _want_gemma4), "moe8": (_qwen3_moe8, _want_moe8)}
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _packed_bytes(ggml_type: T, shape: tuple[int, ...]) -> int:
    elems, nbytes = GGML_QUANT_SIZES[ggml_type]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * shape[-1] // elems * nbytes


def _expected(cfg: dict, want) -> tuple[dict[str, list], int, int]:
    """({sparrow linear name: its segments' types}, packed bytes of the dense linears, of the experts), from the
    HF skeleton's weights and ``want``."""
    segments: dict[str, list] = {}
    dense = experts = 0
    for name, p in hf_skeleton(cfg, torch.float32).named_parameters():
        parts = name.split(".")
        if "layers" not in parts or p.dim() < 2 or parts[-2] in ("gate", "proj"):  # routers stay float
            continue
        layer, module = int(parts[2]), ".".join(parts[:-2])
        if ".experts." in name + ".":
            experts += _packed_bytes(want(layer, "experts." + parts[-1]), tuple(p.shape))
            continue
        proj = parts[-2]
        ggml_type = want(layer, proj)
        dense += _packed_bytes(ggml_type, tuple(p.shape))
        fused = next((f for f, shards in _SHARDS.items() if proj in shards), proj)
        segs = segments.setdefault(f"{module}.{fused}", [])
        if not segs or segs[-1] != ggml_type:  # consecutive shards of one type run as one segment
            segs.append(ggml_type)
    return segments, dense, experts


def _llm(model) -> LLM:
    return LLM.from_model(model, max_model_len=64, num_kv_blocks=16, enable_prefix_caching=False)


def _run(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 13))}, {"prompt_token_ids": [3, 99, 7, 250, 41]}],
                        params)
    return [(o.outputs[0].token_ids, [lp for d in o.prompt_logprobs[1:] + o.outputs[0].logprobs
                                      for lp in sorted((t, v.logprob) for t, v in d.items())]) for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_types_and_float_oracle(case):
    """Every linear shard and expert stack is packed in the type llama.cpp's Q4_K_M recipe gives it, and the model
    computes what the float model of the dequantized blocks computes (fp32: greedy ids equal, logprobs within
    1e-4; the GGUF twin sums in another order than F.linear)."""
    from sparrow.config import ModelConfig
    from sparrow.loader.model_loader import build_model, finish_loading
    from sparrow.loader.weights import load_weights
    from sparrow.model_shapes import full_config_dict
    from sparrow.models.registry import get_model_class
    from sparrow.quant.gguf import dequantize_packed

    make, want = CASES[case]
    cfg = make()
    model = random_model(cfg, torch.float32, "cpu", "gguf-q4_k_m", seed=0)
    segments, _, _ = _expected(cfg, want)
    got = {name: [T(t) for t, _, _ in m.gguf_segments] for name, m in model.named_modules()
           if hasattr(m, "gguf_segments")}
    assert got == segments
    moe = {name: (T(m.gate_up_type), T(m.down_type)) for name, m in model.named_modules() if hasattr(m, "down_type")}
    if case != "dense":
        assert moe and all(v == (Q4, want(int(k.split(".")[2]), "experts.down_proj")) for k, v in moe.items()), moe
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embedding takes float: dequantized blocks

    mcfg = ModelConfig.from_hf(full_config_dict(cfg))
    oracle = build_model(get_model_class(mcfg.architecture), mcfg, torch.float32, "cpu", None)
    load_weights(oracle, ((n, dequantize_packed(t, n)) for n, t in
                          random_gguf_weights(cfg, "gguf-q4_k_m", torch.float32, "cpu", seed=0)))
    finish_loading(oracle, None)
    ours, ref = _run(_llm(model)), _run(_llm(oracle))
    for (ids, lps), (ref_ids, ref_lps) in zip(ours, ref):
        assert ids == ref_ids
        assert [t for t, _ in lps] == [t for t, _ in ref_lps]
        torch.testing.assert_close(torch.tensor([v for _, v in lps]), torch.tensor([v for _, v in ref_lps]),
                                   atol=1e-4, rtol=0)
        values = torch.tensor([v for _, v in lps])
        assert torch.isfinite(values).all() and values.max() - values.min() > 0.1  # not a flat (all-zero) model


def test_same_seed_same_blocks():
    """The stream is a function of the seed (the oracle test above builds its float model from a second stream of
    seed 0); gguf-q8_0 makes every linear and expert weight Q8_0, routers and norms float."""
    def stream(seed):
        return list(random_gguf_weights(_qwen3_moe8(), "gguf-q8_0", torch.float32, "cpu", seed=seed))

    a, b, c = stream(0), stream(0), stream(1)
    assert [n for n, _ in a] == [n for n, _ in b] == [n for n, _ in c]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    packed = [(n, t) for n, t in a if getattr(t, "ggml_type", None) is not None]
    assert not any(torch.equal(x, y) for (_, x), (_, y) in zip(packed, (p for p in c if p[0] in dict(packed))))
    assert {T(t.ggml_type) for _, t in packed} == {Q8}
    names = {n for n, _ in packed}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "lm_head.weight" in names
    floats = {n for n, t in a if t.is_floating_point()}
    assert "model.layers.0.mlp.gate.weight" in floats and "model.norm.weight" in floats
    assert len(names) + len(floats) == len(a)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                                       T.Q6_K])
def test_random_blocks_are_finite_near_the_std(ggml_type):
    from sparrow.kernels.common.gguf_blocks import dequantize

    blocks = random_blocks(ggml_type, (64, 512), torch.Generator().manual_seed(3), "cpu")
    assert blocks.dtype == torch.uint8 and blocks.shape == (64, _packed_bytes(ggml_type, (1, 512)))
    assert blocks.ggml_type == ggml_type
    w = dequantize(blocks, ggml_type, (64, 512))
    assert torch.isfinite(w).all() and 0.7 * STD < w.std() < 1.4 * STD and abs(w.mean()) < 0.2 * STD


def test_unknown_quantization_names_the_recipes(capsys):
    from sparrow.cli import main

    assert main(["bench", "--device", "cpu", "--quantization", "gguf-q4_k_m", "--no-hf"]) == 2  # no --model-shape
    assert "needs --model-shape" in capsys.readouterr().err
    with pytest.raises(InvalidRequestError, match="gguf-q4_k_m"):
        random_model(_dense(), torch.float32, "cpu", "gguf-q3_k_s")
    with pytest.raises(InvalidRequestError, match="gguf-q8_0"):
        random_model(_dense(), torch.float32, "cpu", "gguf")  # the file format itself cannot quantize floats


def test_bench_bytes_are_the_packed_bytes(tmp_path, monkeypatch):
    """``sparrow bench --quantization gguf-q4_k_m``: the dense group is the linears' packed bytes plus the float
    norms / routers, the experts group the stacks' packed bytes, a step reading the hit fraction of them."""
    from sparrow.cli import main

    cfg = _gemma4()
    monkeypatch.setitem(SHAPES, "tiny-gguf", cfg)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--model-shape", "tiny-gguf", "--quantization", "gguf-q4_k_m", "--no-hf",
               "--batch-sizes", "1,3", "--prompt-len", "5", "--decode-tokens", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    _, dense, experts = _expected(cfg, _want_gemma4)
    floats = sum(p.numel() * 4 for n, p in hf_skeleton(cfg, torch.float32).state_dict().items()  # + layer_scalar
                 if not n.startswith(("model.embed_tokens", "lm_head")) and (p.dim() < 2 or n.split(".")[-2] in
                                                                             ("gate", "proj")))
    weights = report["meta"]["bytes_model"]["weight_bytes"]
    assert weights["experts"] == experts
    assert weights["dense"] == dense + floats
    assert weights["embedding"] == cfg["vocab_size"] * cfg["hidden_size"] * 4  # tied: the float LM head too
    e, k = cfg["num_experts"], cfg["top_k_experts"]
    for r in report["results"]:
        by = r["bytes_per_step_by_group"]
        assert by["experts"] == pytest.approx(experts * (1 - (1 - k / e) ** r["batch"]))
        assert by["dense"] == dense + floats
        assert r["bytes_per_step"] == pytest.approx(sum(v for g, v in by.items() if g != "total"))
