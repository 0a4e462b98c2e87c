"""The HF architecture names sparrow runs: each maps to the ``sparrow.models`` module and class that builds it.
``ModelConfig.from_hf`` resolves a config's ``architectures`` against this table; the model
registry (``sparrow.models.registry.get_model_class``) imports the class it names. The table is data, kept in
the config package so that normalizing a config needs no model code."""
from __future__ import annotations

from sparrow.errors import UnsupportedArchitectureError

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen3_moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
}
"""HF architecture name -> (module under sparrow.models, class name)."""


def supported_architectures() -> list[str]:
    """Every HF architecture name sparrow can run."""
    return sorted(ARCHITECTURES)


def register(architecture: str, module: str, cls: str) -> None:
    """Add an architecture (module is relative to sparrow.models)."""
    ARCHITECTURES[architecture] = (module, cls)


def resolve_architecture(cfg: dict) -> str:
    """The first supported name in cfg['architectures']; UnsupportedArchitectureError naming it otherwise."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
        raise UnsupportedArchitectureError(f"config has architectures={archs!r}; it must be a list of names, e.g. "
                                           f"[\"LlamaForCausalLM\"]")
    for a in archs:
        if a in ARCHITECTURES:
            return a
    name = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r} (no 'architectures' field)"
    raise UnsupportedArchitectureError(
        f"unsupported architecture {name}; supported: {', '.join(supported_architectures())}"
    )
