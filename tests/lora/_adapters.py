"""Tiny random base models and PEFT adapters made here (random A and B: ``init_lora_weights=False``), and PEFT's
greedy oracle on them (transformers fp32, CPU)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.models._hf_tiny import DENSE, FAMILIES, build, hf_greedy

DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER_PARAMS = ["mlp.gate.weight"]
GEMMA4_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def base_model(family: str, path: Path) -> Path:
    """Build and save a tiny random model of ``family`` (a DENSE or MoE family of tests/models/_hf_tiny) at ``path``."""
    build(DENSE if family in DENSE else FAMILIES, family, path)
    return path


def hf_base(family: str, path: Path):
    import transformers

    table = DENSE if family in DENSE else FAMILIES
    return getattr(transformers, table[family][1]).from_pretrained(str(path), dtype=torch.float32).eval()


def make_adapter(family: str, base: Path, out: Path, seed: int, scale: float = 0.3, safe_serialization: bool = True,
                 **lora_kw) -> Path:
    """A PEFT LoRA adapter for the model at ``base`` with random A and B (seeded; entries of std scale / sqrt(fan
    in)), saved to ``out`` (``safe_serialization=False``: as ``adapter_model.bin``, PEFT's older format)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_base(family, base), LoraConfig(init_lora_weights=False, **lora_kw))
    with torch.no_grad():  # B random too, and small enough that outputs change without saturating
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
    model.save_pretrained(str(out), safe_serialization=safe_serialization)
    return out


def peft_greedy(family: str, base: Path, adapter: Path | None, prompt: list[int], n: int):
    """PEFT's greedy ids [n] and logits [n, V] of ``prompt`` under ``adapter`` (None: the base model)."""
    from peft import PeftModel

    model = hf_base(family, base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return hf_greedy(model, prompt, n)
