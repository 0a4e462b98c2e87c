"""Peak process memory while loading an HF safetensors checkpoint, against its size on disk (issue 3: target
peak <= 1.3x the checkpoint).

Builds a random Qwen3-MoE-shaped checkpoint (bf16, one file, experts stored per expert as transformers saves
them, or fused 3-D with --fused), then loads it with ``sparrow.loader.model_loader.load_model`` in bf16 in a
child process and reports:
- peak RSS of the child (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``), whole process;
- the child's RSS after ``import torch, sparrow`` and before loading (the interpreter + libraries);
- peak / disk and (peak - baseline) / disk: the memory the load itself costs per byte of checkpoint.

    python benchmarks/load_memory.py [--layers 6] [--experts 32] [--fused] [--dir /tmp/sparrow-loadmem]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import resource, sys, time
import torch
import sparrow
from sparrow.loader.model_loader import load_model

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

base = rss_kib()
t = time.perf_counter()
m = load_model(sys.argv[1], dtype=torch.bfloat16)
dt = time.perf_counter() - t
n = sum(p.numel() * p.element_size() for p in m.model.parameters())
print(f"{base} {rss_kib()} {n} {dt:.2f}")
"""


def build(folder: Path, layers: int, experts: int, fused: bool, seed: int = 0) -> int:
    """Write config.json + model.safetensors; returns the file size in bytes."""
    import torch
    from safetensors.torch import save_file

    h, inter, moe_i, heads, kv, d, vocab = 1024, 2816, 256, 16, 4, 64, 32000
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=vocab, hidden_size=h,
               intermediate_size=inter, moe_intermediate_size=moe_i, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=d, num_experts=experts,
               num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": rnd(vocab, h), "lm_head.weight": rnd(vocab, h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "self_attn.q_proj.weight": rnd(heads * d, h), p + "self_attn.k_proj.weight": rnd(kv * d, h),
                  p + "self_attn.v_proj.weight": rnd(kv * d, h), p + "self_attn.o_proj.weight": rnd(h, heads * d),
                  p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "mlp.gate.weight": rnd(experts, h)})
        if fused:
            t[p + "mlp.experts.gate_up_proj"] = rnd(experts, 2 * moe_i, h)
            t[p + "mlp.experts.down_proj"] = rnd(experts, h, moe_i)
        else:
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                t.update({q + "gate_proj.weight": rnd(moe_i, h), q + "up_proj.weight": rnd(moe_i, h),
                          q + "down_proj.weight": rnd(h, moe_i)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    return (folder / "model.safetensors").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--fused", action="store_true", help="store experts as fused 3-D tensors (transformers 5)")
    ap.add_argument("--dir", default="/tmp/sparrow-loadmem")
    args = ap.parse_args()
    folder = Path(args.dir) / ("fused" if args.fused else "per-expert")
    size = build(folder, args.layers, args.experts, args.fused)
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(out.stderr)
    base_kib, after_kib, param_bytes, secs = out.stdout.split()[-4:]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    base, mib = int(base_kib) * 1024, 1 << 20
    print(f"checkpoint {folder}: {size / mib:.0f} MiB on disk ({'fused' if args.fused else 'per-expert'} experts), "
          f"parameters {int(param_bytes) / mib:.0f} MiB, loaded in {secs} s")
    print(f"peak RSS {peak / mib:.0f} MiB = {peak / size:.2f}x disk; baseline after imports {base / mib:.0f} MiB; "
          f"load cost (peak - baseline) {(peak - base) / mib:.0f} MiB = {(peak - base) / size:.2f}x disk")


if __name__ == "__main__":
    main()
