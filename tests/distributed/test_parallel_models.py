"""Tensor and expert parallelism of the model side on two gloo CPU ranks, against the one-rank model (fp32).

Each rank builds and loads the model as a plain process does (``sparrow.loader.model_loader.load_model`` after
``init_distributed`` / ``set_expert_parallel``) and runs the prompts of ``tests.models._hf_tiny.prompts`` as one
prefill step (``tests.distributed._forward``). Checked: the logits of every row equal the one-rank model's within
1e-4 on both ranks, and (float models, one way each) greedy ids equal up to the first step whose one-rank top-2 gap is < 1e-4; the KV cache is
sized from the rank's heads. Models: tiny Llama (TP), Qwen3-MoE (no shared expert), Qwen2-MoE (sigmoid-gated
shared expert), Gemma 4 (dense MLP beside the MoE, replicated KV head on full layers), each under TP=2, EP=2
all_reduce and EP=2 all_to_all; MiniMax-M2 (whole-projection q/k norms over the ranks' shares) under TP and
all_to_all. Formats: FP8 and int4 on-load quantization on a Qwen3-MoE whose splits fall on
the formats' blocks (so a rank's quantized share is the share of the one-rank quantized weight: 1e-4 again); NVFP4
on-load quantizes each share with its own global scale, so there a rank's weight must equal the NVFP4 round trip
of its float share and its logits be as close to the float model's as the one-rank NVFP4 model's are (NMSE within
1.5x); a GGUF file (packed
Q4_K / Q6_K / Q8_0 / Q5_0 rows split by rows and by whole blocks of bytes); an FP8 block-scaled checkpoint, an
int4 compressed-tensors one (asymmetric, group 32: packed words, groups and N-packed zero points cut) and NVFP4
checkpoints of both layouts (codes and 16-groups cut, the tensor's global scale on every rank). Errors: 3 heads on 2 ranks, and a GGUF
K split inside a 256-element block, raise ModelLoadError naming them.

Each ``run_ranks`` costs a few seconds of process start-up, so each test puts all its checks in one run.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed._forward import prefill_logits
from tests.distributed._ranks import run_ranks
from tests.models._hf_tiny import DENSE, FAMILIES, TIE_GAP, build, prompts

ATOL = 1e-4
STEPS = 3
MODES = ("tp", "all_reduce", "all_to_all")
# splits on 128-element blocks: FP8 (128 x 128) and int4 (groups of 128) quantize a share as the whole
ALIGNED = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=2, head_dim=128, num_experts=4, vocab_size=256, num_hidden_layers=2)
GGUF = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=128, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            mlp_only_layers=[], use_sliding_window=False, sliding_window=None)


def _load(path, mode: str | None, quantization: str | None = None):
    from sparrow.distributed import set_expert_parallel
    from sparrow.loader.model_loader import load_model

    set_expert_parallel(mode in ("all_reduce", "all_to_all"), mode if mode != "tp" else "all_reduce")
    try:
        return load_model(path, quantization=quantization).model
    finally:
        set_expert_parallel(False)


def _greedy(model, prompt: list[int], n: int = STEPS) -> tuple[list[int], list[float]]:
    """n greedy ids after ``prompt`` and each step's top-2 logit gap."""
    seq, gaps = list(prompt), []
    for _ in range(n):
        last = prefill_logits(model, [seq])[-1]
        top2 = last.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        seq.append(int(last.argmax()))
    return seq[len(prompt):], gaps


def _same_greedy(got: list[int], want: list[int], gaps: list[float], what: str) -> None:
    for step, (g, w, gap) in enumerate(zip(got, want, gaps)):
        if gap < TIE_GAP:
            return
        assert g == w, f"{what}: step {step}: greedy {got} != one rank's {want}"


def _reference(path, quantization=None, greedy=True):
    model = _load(path, None, quantization)
    from sparrow.kv_cache import kv_bytes_per_token

    return dict(logits=prefill_logits(model, prompts()), greedy=_greedy(model, prompts()[0]) if greedy else None,
                kv=kv_bytes_per_token(model, torch.float32))


def _check(rank, name, model, ref, atol=ATOL, greedy=True) -> None:
    got = prefill_logits(model, prompts())
    diff = float((got - ref["logits"]).abs().max())
    assert diff <= atol, f"rank {rank} {name}: logits differ from one rank's by {diff}"
    if greedy and ref["greedy"] is not None:
        ids, _ = _greedy(model, prompts()[0])
        _same_greedy(ids, ref["greedy"][0], ref["greedy"][1], f"rank {rank} {name}")


# ---- float models under TP=2 and EP=2 (both dispatch modes) --------------------------------------------------------

def _ranks_float(rank, world, cases):
    from sparrow.kv_cache import kv_bytes_per_token

    for family, path, modes, ref in cases:
        for mode in modes:
            model = _load(path, mode)
            _check(rank, f"{family} {mode}", model, ref, greedy=mode == modes[-1])
            if family == "llama":  # 2 KV heads: one a rank
                assert kv_bytes_per_token(model, torch.float32) * world == ref["kv"]
            if family == "gemma4":  # full layers' single KV head is replicated
                heads = [a.num_kv_heads for a in model.attention_layers()]
                assert heads == [1, 1, 1, 1], heads


def test_float_models_tp_and_ep_match_one_rank(tmp_path):
    cases = []
    for family, table, modes in (("llama", DENSE, ("tp",)), ("qwen3_moe", FAMILIES, MODES),
                                 ("qwen2_moe", FAMILIES, MODES), ("gemma4", FAMILIES, MODES),
                                 ("minimax_m2", FAMILIES, ("tp", "all_to_all"))):
        path = tmp_path / family
        build(table, family, path)
        cases.append((family, path, modes, _reference(path)))
    run_ranks(_ranks_float, 2, cases)


# ---- weight formats --------------------------------------------------------------------------------------------------

def _ranks_formats(rank, world, aligned, refs, nvfp4, gguf, gguf_ref, odd_heads, gguf_unaligned, checkpoints):
    from sparrow.errors import ModelLoadError
    from sparrow.kernels.gemm.nvfp4 import dequantize_nvfp4_ref, quantize_nvfp4_ref
    from safetensors.torch import load_file

    for quantization, mode in (("fp8", "tp"), ("int4", "all_to_all")):
        _check(rank, f"{quantization} {mode}", _load(aligned, mode, quantization), refs[quantization])
    for name, (path, ref) in checkpoints.items():  # block scales / packed words, groups, zero points cut
        _check(rank, f"{name} checkpoint tp", _load(path, "tp"), ref)
    # NVFP4: each share quantized on its own (its own global scale)
    model = _load(aligned, "tp", "nvfp4")
    o_proj = model.model.layers[0].self_attn.o_proj
    full = load_file(str(aligned / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    k = full.shape[1] // world
    codes, scale, g = quantize_nvfp4_ref(full[:, rank * k:(rank + 1) * k], "modelopt")
    assert torch.equal(o_proj.quant_method.dequantized_weight(o_proj), dequantize_nvfp4_ref(codes, scale, g))
    got = prefill_logits(model, prompts())
    exact = nvfp4["float"]
    err = float(((got - exact) ** 2).mean() / (exact ** 2).mean())
    assert err < 1.5 * nvfp4["noise"], (err, nvfp4["noise"])  # as close to the float model as one rank's NVFP4
    # GGUF: packed rows split by rows (column) and by whole blocks of bytes (row)
    for mode in ("tp", "all_reduce"):
        _check(rank, f"gguf {mode}", _load(gguf, mode), gguf_ref, atol=1e-3)
    for path, needles in ((odd_heads, ("num_attention_heads", "(3)")), (gguf_unaligned, ("o_proj.weight", "256-element"))):
        with pytest.raises(ModelLoadError) as e:
            _load(path, "tp")
        assert all(n in str(e.value) for n in needles), str(e.value)


def test_weight_formats_tp_and_ep_match_one_rank(tmp_path):
    from tests.loader._gguf_writer import write_gguf

    aligned = tmp_path / "aligned"
    build(FAMILIES, "qwen3_moe", aligned, **ALIGNED)
    refs = {q: _reference(aligned, q, greedy=False) for q in ("fp8", "int4")}
    nvfp4 = _reference(aligned, "nvfp4", greedy=False)
    exact = _reference(aligned, greedy=False)["logits"]
    nvfp4["noise"] = float(((nvfp4["logits"] - exact) ** 2).mean() / (exact ** 2).mean())  # one rank's NVFP4 error
    nvfp4["float"] = exact
    gguf = tmp_path / "m.gguf"
    write_gguf(build(FAMILIES, "qwen3_moe", tmp_path / "gguf-hf", **GGUF), "qwen3_moe", gguf)
    odd_heads = tmp_path / "odd"
    build(DENSE, "llama", odd_heads, num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    gguf_unaligned = tmp_path / "unaligned.gguf"
    write_gguf(build(FAMILIES, "qwen3_moe", tmp_path / "unaligned-hf", **{**GGUF, "num_attention_heads": 2,
                                                                           "num_hidden_layers": 1}),
               "qwen3_moe", gguf_unaligned)
    from tests.quant.test_fp8 import write_fp8_checkpoint
    from tests.quant.test_int4 import write_ct_checkpoint
    from tests.quant.test_nvfp4 import write_nvfp4

    dense = tmp_path / "dense"
    build(DENSE, "llama", dense, **{k: v for k, v in ALIGNED.items() if "expert" not in k})
    fp8 = write_fp8_checkpoint(dense, tmp_path / "fp8")
    ct = write_ct_checkpoint(build(FAMILIES, "qwen3_moe", tmp_path / "ct-hf", **ALIGNED), tmp_path / "ct", 32, False)
    checkpoints = {"fp8": (fp8, _reference(fp8, greedy=False)), "int4": (ct, _reference(ct, greedy=False))}
    for layout in ("modelopt", "compressed-tensors"):  # a whole tensor's global scale: shares as the whole's
        nv, _ = write_nvfp4(dense, tmp_path / f"nvfp4-{layout}", layout)
        checkpoints[f"nvfp4 {layout}"] = (nv, _reference(nv, greedy=False))
    run_ranks(_ranks_formats, 2, aligned, refs, nvfp4, gguf, _reference(gguf, greedy=False), odd_heads,
              gguf_unaligned,
              checkpoints)


# ---- LoRA shards --------------------------------------------------------------------------------------------------

def _with_adapter(model, folder):
    from sparrow.lora.manager import LoRAManager
    from sparrow.lora.request import LoRARequest

    manager = LoRAManager(model, 1, 8, torch.float32, torch.device("cpu"))
    request = LoRARequest("a", 1, str(folder))
    manager.load(request)
    slots, errors = manager.assign({1: request})
    assert not errors, errors
    return prefill_logits(model, prompts(), slots[1])


def _ranks_lora(rank, world, cases):
    for family, path, adapter, modes, want in cases:
        for mode in modes:
            diff = float((_with_adapter(_load(path, mode), adapter) - want).abs().max())
            assert diff <= ATOL, f"rank {rank} {family} {mode} + LoRA: logits differ from one rank's by {diff}"


def test_lora_shards_match_one_rank(tmp_path):
    """Dense adapters (q/k/v/o, gate/up/down: column B rows, row A columns) and fused expert adapters (PEFT
    target_parameters: width cut under TP, experts under EP, pairs' adapters sent with them under all_to_all)."""
    from tests.lora._adapters import DENSE_TARGETS, EXPERT_PARAMS, ROUTER_PARAMS, make_adapter

    cases = []
    for family, table, modes, params in (("llama", DENSE, ("tp",), None),
                                         ("qwen3_moe", FAMILIES, MODES, EXPERT_PARAMS + ROUTER_PARAMS)):
        path = tmp_path / family
        build(table, family, path)
        adapter = make_adapter(family, path, tmp_path / f"{family}-lora", 1, scale=1.0, r=4, lora_alpha=8,
                               target_modules=DENSE_TARGETS, target_parameters=params)
        base = prefill_logits(_load(path, None), prompts())
        want = _with_adapter(_load(path, None), adapter)
        assert float((want - base).abs().max()) > 1e-2  # the adapter changes the logits
        cases.append((family, path, adapter, modes, want))
    run_ranks(_ranks_lora, 2, cases)
