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
    # the flagship
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


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside: every ``nn.Parameter`` a module registers moves to the meta device (no memory); buffers stay where
    they are built (rope tables, Gemma 4's ``layer_scalar``: small, and their values come from ``__init__``)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def hf_skeleton(cfg: dict, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' causal LM for a shape dict with its parameters on the meta device (names, shapes, dtypes,
    ties) and its buffers built on the CPU: what ``random_weights`` fills one module at a time."""
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"), _no_init(), _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype)
    model.tie_weights()  # skipped under no_init_weights; ties lm_head to the embedding where the config says so
    return model


@torch.no_grad()
def random_weights(cfg: dict, dtype: torch.dtype, device: str, seed: int = 0, std: float = 0.02, blocks=None):
    """Yield (name, tensor) for every parameter and persistent buffer of the shape's transformers model (its
    ``state_dict`` names, a tied LM head once, as ``save_pretrained`` writes it), each made on ``device`` only when
    its module comes up, so a consumer that copies and drops them (``loader.weights.load_weights``, on-load
    quantization) never holds the float model: the bound of loading in bounded memory holds for random shapes.
    Values: every matrix / expert stack ~ N(0, std) from one ``torch.Generator(device)`` seeded with ``seed``, in
    ``model.parameters()`` order; every module holding a vector parameter (norms, biases, router scales) then gets
    transformers' own ``_init_weights`` (norm weights 1, or 0 for Gemma's 1 + w), which keeps bf16 activations
    finite. ``blocks(name, shape, gen)``: the (name, tensor) pairs to yield instead of matrix / expert stack
    ``name``'s floats, which are then never made, or None to keep them (random GGUF blocks: ``random_gguf_weights``).
    Same arguments, same tensors. Raises RuntimeError if a tensor is left non-finite."""
    model = hf_skeleton(cfg, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    hf_init = getattr(model, "_init_weights", None)
    persistent = set(model.state_dict())
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        prefix = prefix + "." if prefix else ""
        for bname, buf in mod.named_buffers(recurse=False):
            if prefix + bname in persistent:
                yield prefix + bname, buf.to(device)
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        swapped = {}
        for n, p in own:  # materialize this module's parameters alone
            swapped[n] = blocks(prefix + n, tuple(p.shape), gen) if blocks is not None and p.dim() >= 2 else None
            if swapped[n] is not None:
                continue  # left on meta: hf_init below touches no memory for it
            mod._parameters[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                    requires_grad=False)
            if p.dim() >= 2:
                mod._parameters[n].normal_(0.0, std, generator=gen)
        if hf_init is not None and any(p.dim() < 2 for _, p in own):
            hf_init(mod)
        for n, meta in own:
            if swapped[n] is not None:
                yield from swapped.pop(n)
                continue
            t = mod._parameters[n].data
            if t.dim() < 2 and not torch.isfinite(t).all():
                t.zero_() if n.endswith("bias") else t.fill_(1.0)
            if not torch.isfinite(t).all():
                raise RuntimeError(f"random init left non-finite values in {prefix + n}")
            mod._parameters[n] = meta  # the consumer's copy is the only one kept
            yield prefix + n, t
            del t


def build_random_hf_model(cfg: dict, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """transformers' causal LM for a shape dict on ``device`` in ``dtype``, filled by ``random_weights`` (the
    same tensors sparrow's ``random_llm`` loads for the same seed), in eval mode."""
    model = hf_skeleton(cfg, dtype)
    model.load_state_dict(dict(random_weights(cfg, dtype, device, seed)), strict=False, assign=True)
    model.tie_weights()
    model.to(device)  # the non-persistent buffers (rope tables)
    return model.eval()


def random_gguf_weights(cfg: dict, quantization: str, dtype: torch.dtype, device: str, seed: int = 0):
    """``random_weights`` of the shape dict ``cfg`` with each weight that llama.cpp's recipe ``quantization``
    ("gguf-q4_k_m", "gguf-q8_0") quantizes made as random GGUF blocks of its type instead (``random_gguf``): uint8
    [rows, K // B * T] carrying ``ggml_type``, stacked experts as per-expert slices (``experts.N.gate_proj.weight``),
    as ``GGUFCheckpoint.tensors(packed=True)`` yields a file; norms and routers float. Streamed one module at a
    time; same arguments, same blocks. Raises InvalidRequestError for a ``quantization`` that is no recipe."""
    from sparrow import random_gguf
    from sparrow.config import ModelConfig

    mcfg = ModelConfig.from_hf(full_config_dict(cfg))
    shapes = [(n, tuple(p.shape)) for n, p in hf_skeleton(cfg, dtype).named_parameters()]
    plan = random_gguf.plan_types(quantization, shapes, mcfg.num_hidden_layers, mcfg.num_experts or 0,
                                  mcfg.tie_word_embeddings)
    return random_weights(cfg, dtype, device, seed=seed, blocks=random_gguf.block_maker(plan, device))


def random_model(cfg: dict, dtype: torch.dtype, device: str, quantization: str | None = None,
                 quantize_lm_head: bool = False, seed: int = 0) -> torch.nn.Module:
    """sparrow's model of the shape dict ``cfg`` on ``device`` in ``dtype`` (eval mode), loaded from a stream made one
    module at a time (the float model never exists whole): ``random_weights`` for ``seed``, quantized at load by
    ``quantization`` (None: float), or for a GGUF recipe ``random_gguf_weights`` in the GGUF format (the linears',
    experts' and vocab tables' blocks kept packed), blocks whose parameter takes float dequantized as the loader does
    a file's. Raises InvalidRequestError for an unknown ``quantization`` or a ``quantize_lm_head`` its format lacks,
    UnsupportedArchitectureError when sparrow lacks the architecture."""
    from sparrow import random_gguf
    from sparrow.config import ModelConfig
    from sparrow.loader.model_loader import build_model, check_quantize_lm_head, finish_loading, packed_or_float
    from sparrow.loader.weights import load_weights
    from sparrow.models.registry import get_model_class

    quant_config = random_gguf.shape_quant_config(quantization)
    check_quantize_lm_head(quantize_lm_head, quant_config)
    mcfg = ModelConfig.from_hf(full_config_dict(cfg))
    model = build_model(get_model_class(mcfg.architecture), mcfg, dtype, device, quant_config)
    if random_gguf.is_recipe(quantization):
        params = dict(model.named_parameters())
        tensors = ((n, packed_or_float(model, params, n, t))
                   for n, t in random_gguf_weights(cfg, quantization, dtype, device, seed=seed))
    else:
        tensors = random_weights(cfg, dtype, device, seed=seed)
    load_weights(model, tensors)
    finish_loading(model, quant_config, quantize_lm_head)
    return model


def build_random_model(name: str, dtype: str, quantization: str | None, quantize_lm_head: bool, seed: int,
                       device: str) -> torch.nn.Module:
    """``random_model`` of the named shape in ``dtype`` (a TORCH_DTYPES name) on ``device``, the argument last: a
    picklable builder every tensor-parallel rank calls with its device (the same weights everywhere)."""
    from sparrow.devices import TORCH_DTYPES

    return random_model(shape_config(name), TORCH_DTYPES[dtype], device, quantization, quantize_lm_head, seed)


def random_llm(name: str, *, device: str = "auto", dtype: str = "auto", quantization: str | None = None,
               quantize_lm_head: bool = False, seed: int = 0, **engine_args):
    """A tokenizer-less ``LLM`` of the named shape with random weights (``random_model``: ``random_weights`` with
    ``seed`` streamed into sparrow's model one module at a time and quantized at load when ``quantization`` names
    a format, or random GGUF blocks of llama.cpp's type mix for "gguf-q4_k_m" / "gguf-q8_0", so the float model
    never exists whole): prompts are token ids, outputs carry token ids and no text. The same arguments give the
    same weights (unquantized: those of ``build_random_hf_model``). ``engine_args``: LLM's engine arguments
    (max_model_len default: the shape's positions, capped as LLM caps them); with tensor_parallel_size > 1 every
    rank builds the shape with the same seed (``LLM.from_builder``). Raises InvalidRequestError for an unknown
    name, device, dtype or format, UnsupportedArchitectureError when sparrow lacks the shape's architecture."""
    import functools
    import gc

    from sparrow.config import ModelConfig
    from sparrow.devices import peak_memory, reset_peak_memory, resolve_device, resolve_dtype
    from sparrow.llm import LLM
    from sparrow.random_gguf import shape_quant_config

    cfg = shape_config(name)
    shape_quant_config(quantization)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    build = functools.partial(build_random_model, name, dtype, quantization, quantize_lm_head, seed)
    if engine_args.get("tensor_parallel_size", 1) > 1:
        return LLM.from_builder(build, ModelConfig.from_hf(full_config_dict(cfg)), device=device, dtype=dtype,
                                **engine_args)
    reset_peak_memory(device)
    model = build(device)
    peak = peak_memory(device)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    llm = LLM.from_model(model, device=device, dtype=dtype, **engine_args)
    llm.load_peak_memory = peak
    return llm
