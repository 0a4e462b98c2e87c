"""Named model shapes for benchmarks, and random-weight transformers models built from them.

Each shape is an HF ``config.json``-style dict (transformers 5 field names, with ``architectures`` and
``model_type``), so the same dict builds transformers' model (``AutoConfig.for_model``) and sparrow's
(``ModelConfig.from_hf``). Weights are random: a benchmark measures speed, not quality.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from sparrow.errors import InvalidRequestError

_GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
}


def _pattern(n_layers: int, sliding_per_full: int) -> list[str]:
    """[sliding x sliding_per_full, full] repeated over n_layers (Gemma 3/4 layer_types)."""
    period = sliding_per_full + 1
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def _gemma4(hidden, layers, heads, kv, head_dim, global_kv, global_head_dim, window, vocab, dense, experts,
            top_k, expert_width) -> dict:
    """A Gemma4TextConfig dict: MoE + dense MLP in every layer, K=V full layers, no per-layer inputs."""
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "hidden_size": hidden, "num_hidden_layers": layers, "layer_types": _pattern(layers, 5),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "num_global_key_value_heads": global_kv, "global_head_dim": global_head_dim, "attention_k_eq_v": True,
        "sliding_window": window, "rope_parameters": copy.deepcopy(_GEMMA4_ROPE),
        "vocab_size": vocab, "tie_word_embeddings": True, "final_logit_softcapping": 30.0,
        "intermediate_size": dense, "hidden_activation": "gelu_pytorch_tanh",
        "enable_moe_block": True, "num_experts": experts, "top_k_experts": top_k, "moe_intermediate_size": expert_width,
        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262_144, "bos_token_id": 2, "eos_token_id": [1, 106],
        "pad_token_id": 0,
    }


def _qwen3_moe(hidden, layers, heads, kv, head_dim, vocab, dense, experts, top_k, expert_width, max_pos) -> dict:
    """A Qwen3MoeConfig dict: every layer sparse, top-k renormalized, untied LM head."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab, "intermediate_size": dense,
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_width,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_pos, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


SHAPES: dict[str, dict] = {
    # design.md §2: the flagship
    "gemma4-26b-a4b": _gemma4(hidden=2816, layers=30, heads=16, kv=8, head_dim=256, global_kv=2, global_head_dim=512,
                              window=1024, vocab=262_144, dense=2112, experts=128, top_k=8, expert_width=704),
    "qwen3-30b-a3b": _qwen3_moe(hidden=2048, layers=48, heads=32, kv=4, head_dim=128, vocab=151_936, dense=6144,
                                experts=128, top_k=8, expert_width=768, max_pos=40_960),
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128_256, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # the packaged default model's shape (its GGUF metadata)
    "gemma3-270m": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262_144, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 512, "layer_types": _pattern(18, 5),
        "rope_parameters": copy.deepcopy(_GEMMA3_ROPE), "rms_norm_eps": 1e-6, "max_position_embeddings": 32_768,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
    # tiny shapes: run on a CPU in seconds (smoke tests)
    "tiny-moe": {**_qwen3_moe(hidden=64, layers=2, heads=4, kv=2, head_dim=16, vocab=512, dense=128, experts=8,
                              top_k=2, expert_width=32, max_pos=4096), "bos_token_id": 1, "eos_token_id": 2},
    "tiny-gemma4": _gemma4(hidden=64, layers=6, heads=4, kv=2, head_dim=16, global_kv=1, global_head_dim=32, window=32,
                           vocab=512, dense=64, experts=8, top_k=2, expert_width=32) | {"max_position_embeddings": 4096},
    "tiny-dense": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
}


def shape_config(name: str) -> dict:
    """A copy of the named shape's config dict; InvalidRequestError listing the names for an unknown one."""
    if name not in SHAPES:
        raise InvalidRequestError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[name])


def hf_config(cfg: dict):
    """transformers' config object (e.g. Gemma4TextConfig) for a shape dict."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    return AutoConfig.for_model(cfg["model_type"], **fields)


def full_config_dict(cfg: dict) -> dict:
    """What ``save_pretrained`` would write as config.json: transformers' defaults, then the shape's own
    fields on top (the form sparrow reads from a real checkpoint)."""
    out = hf_config(cfg).to_dict()
    out.update(copy.deepcopy(cfg))
    return out


def _no_init():
    """transformers' context that skips its (slow, CPU-bound) weight init; a no-op when unavailable."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


@torch.no_grad()
def init_random_(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fill a transformers model in place, on its device: every matrix / expert stack ~ N(0, std); every
    module holding a vector parameter (norms, biases, router scales) gets transformers' own ``_init_weights``
    (norm weights 1, or 0 for Gemma's 1 + w). Keeps bf16 activations finite: unit-scale norms, small
    matrices. Raises RuntimeError if a parameter is left non-finite."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
    hf_init = getattr(model, "_init_weights", None)
    for mod in model.modules():
        if any(p.dim() < 2 for p in mod.parameters(recurse=False)) and hf_init is not None:
            hf_init(mod)
    for name, p in model.named_parameters():
        if p.dim() < 2 and not torch.isfinite(p).all():
            p.zero_() if name.endswith("bias") else p.fill_(1.0)
        if not torch.isfinite(p).all():
            raise RuntimeError(f"random init left non-finite values in {name}")


def build_random_hf_model(cfg: dict, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """transformers' causal LM for a shape dict, allocated directly on ``device`` in ``dtype`` with random
    weights (``init_random_``), in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device(device), _no_init():
        model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype)
    if next(model.parameters()).device.type != torch.device(device).type:  # a transformers that ignores torch.device
        model.to(device)
    model.tie_weights()  # skipped under no_init_weights; ties lm_head to the embedding where the config says so
    init_random_(model, seed=seed)
    return model.eval()


def random_llm(name: str, *, device: str = "auto", dtype: str = "auto", quantization: str | None = None,
               quantize_lm_head: bool = False, seed: int = 0, **engine_args):
    """A tokenizer-less ``LLM`` of the named shape with random weights (``build_random_hf_model`` with
    ``seed``, copied into sparrow's model, then quantized at load when ``quantization`` names a format):
    prompts are token ids, outputs carry token ids and no text. The same arguments give the same weights.
    transformers' copy is freed before the engine sizes its KV pool (``gpu_memory_utilization`` of the
    memory then free). ``engine_args``: LLM's engine arguments (max_model_len default: the shape's
    positions, capped as LLM caps them). Raises InvalidRequestError for an unknown name, device, dtype or
    format, UnsupportedArchitectureError when sparrow lacks the shape's architecture."""
    import gc

    from sparrow.config import ModelConfig
    from sparrow.devices import TORCH_DTYPES, resolve_device, resolve_dtype
    from sparrow.engine.llm import LLM
    from sparrow.loader.model_loader import build_model, finish_loading
    from sparrow.loader.weights import load_weights
    from sparrow.models.registry import get_model_class
    from sparrow.quant import check_quantization, config_for_quantization

    cfg = shape_config(name)
    check_quantization(quantization)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    mcfg = ModelConfig.from_hf(full_config_dict(cfg))
    cls = get_model_class(mcfg.architecture)
    hf = build_random_hf_model(cfg, TORCH_DTYPES[dtype], device, seed=seed)
    quant_config = config_for_quantization(quantization)
    model = build_model(cls, mcfg, TORCH_DTYPES[dtype], device, quant_config)
    load_weights(model, hf.state_dict().items())
    del hf
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    finish_loading(model, quant_config, quantize_lm_head)
    return LLM.from_model(model, device=device, dtype=dtype, **engine_args)
