"""Loading in bounded host memory: a bf16 checkpoint loaded on CPU with each on-load quantization peaks at most at
the final weights + one decoder layer's bf16 weights + 10 % above the process's RSS before loading (issue 40).

Each load runs in a fresh child process: its RSS after loading a one-layer copy of the model in the same format
(the lazy imports and first calls a load makes) is the baseline, and its ``VmHWM`` (reset there through
``/proc/self/clear_refs``; ``ru_maxrss`` would also carry the forking parent's peak across exec) the peak, and the final weights are the bytes of every parameter and buffer once loaded. The
checkpoints are random, written tensor by tensor as transformers names them (a dense Llama, and a Qwen3-MoE
with its 128 experts stored per expert, as Qwen3-30B-A3B ships), so the loader meets one layer's tensors
together as in a real file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

CHILD = r"""
import ctypes, gc, json, sys
import torch
import sparrow
from sparrow.loader.model_loader import load_model


def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))


quantization = sys.argv[2]
load_model(sys.argv[1] + "-warm", dtype=torch.bfloat16, quantization=quantization)  # lazy imports, first calls
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
base = status("VmRSS")
m = load_model(sys.argv[1], dtype=torch.bfloat16, quantization=quantization)
final = sum(t.numel() * t.element_size() for t in [*m.model.parameters(), *m.model.buffers()])
print(json.dumps({"quantization": quantization, "base": base, "peak": status("VmHWM"), "final": final}))
"""

H, HEADS, KV, D, VOCAB, MOE_I = 1024, 16, 4, 64, 8192, 64


def _attention(t: dict, p: str, rnd, ones, qk_norm: bool) -> None:
    t.update({p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
              p + "self_attn.q_proj.weight": rnd(HEADS * D, H), p + "self_attn.k_proj.weight": rnd(KV * D, H),
              p + "self_attn.v_proj.weight": rnd(KV * D, H), p + "self_attn.o_proj.weight": rnd(H, HEADS * D)})
    if qk_norm:
        t.update({p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D)})


def _write(folder: Path, kind: str, layers: int = 6) -> int:
    """Write a random bf16 checkpoint of ``kind`` ("dense" | "moe"); returns one decoder layer's bytes."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    cfg = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS,
               num_key_value_heads=KV, head_dim=D, max_position_embeddings=2048, rms_norm_eps=1e-6,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    if kind == "dense":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=4096)
    else:
        cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=1024,
                   moe_intermediate_size=MOE_I, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    t = {"model.embed_tokens.weight": rnd(VOCAB, H), "lm_head.weight": rnd(VOCAB, H), "model.norm.weight": ones(H)}
    layer_bytes = 0
    for i in range(layers):
        p, before = f"model.layers.{i}.", set(t)
        _attention(t, p, rnd, ones, qk_norm=kind == "moe")
        if kind == "dense":
            t.update({p + "mlp.gate_proj.weight": rnd(4096, H), p + "mlp.up_proj.weight": rnd(4096, H),
                      p + "mlp.down_proj.weight": rnd(H, 4096)})
        else:
            t[p + "mlp.gate.weight"] = rnd(128, H)
            for e in range(128):
                q = f"{p}mlp.experts.{e}."
                t.update({q + "gate_proj.weight": rnd(MOE_I, H), q + "up_proj.weight": rnd(MOE_I, H),
                          q + "down_proj.weight": rnd(H, MOE_I)})
        layer_bytes = sum(t[n].numel() * 2 for n in set(t) - before)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    return layer_bytes


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loadmem") / request.param
    _write(folder.with_name(folder.name + "-warm"), request.param, layers=1)
    return folder, _write(folder, request.param)


FORMATS = ("fp8", "int4", "nvfp4")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads VmRSS / VmHWM from /proc (Linux)")
def test_on_load_quantization_peaks_under_final_plus_one_layer(checkpoint):
    folder, layer_bytes = checkpoint
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(folder), q], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={**os.environ, "MALLOC_ARENA_MAX": "1"})
                for q in FORMATS]  # one process a format
    runs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stderr[-3000:]
        runs += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [r["quantization"] for r in runs] == list(FORMATS)
    disk, mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")), 1 << 20
    for m in runs:
        bound = 1.1 * (m["final"] + layer_bytes)
        cost = m["peak"] - m["base"]
        assert cost <= bound, (f"{folder.name} {m['quantization']}: load cost {cost / mib:.0f} MiB above baseline > "
                               f"bound {bound / mib:.0f} MiB (final {m['final'] / mib:.0f} MiB + layer "
                               f"{layer_bytes / mib:.0f} MiB, + 10 %)")
        assert m["final"] < disk  # it did quantize
