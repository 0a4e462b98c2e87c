"""Tiny random HF checkpoints of every architecture sparrow runs, and transformers' greedy oracle on them.

Shared by tests/models/test_moe_families.py, test_dense_hf.py, test_soft_tokens.py and
tests/loader/test_loading_errors.py. Models are made with transformers (fp32, fixed seed), their 1-D
scales (norm weights, router scales, layer scalars, correction biases) perturbed away from their 0/1
initial values so that every convention (w vs 1 + w, per-expert scale, bias-only-selects) is exercised,
and saved with ``save_pretrained``. Ids and logprobs are compared up to the first step where
transformers' top-2 logit gap is below ``TIE_GAP`` (either engine may break a near-tie either way).
"""
from __future__ import annotations

from pathlib import Path

import torch

TIE_GAP = 1e-4
LOGPROB_ATOL = 1e-4
VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)


def _gemma4_text(**kw):
    return dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=24,
                hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=30.0,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                **{**BASE, "num_hidden_layers": 4, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}, **kw)


# family -> (config class name, model class name, config overrides)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        BASE, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True, sliding_window=8, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        BASE, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
        use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        BASE, num_local_experts=4, num_experts_per_tok=1, intermediate_size=48, sliding_window=8)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        BASE, num_local_experts=8, num_experts_per_tok=3, intermediate_size=32, head_dim=16, rotary_dim=8,
        # transformers < 5.2x ignores the legacy rotary_dim field; say it in rope_parameters too
        rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5),
        bos_token_id=None, eos_token_id=None)),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", _gemma4_text()),
}

DENSE = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(BASE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(BASE, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(BASE, head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(BASE, sliding_window=8, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        BASE, num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, pad_token_id=0)),
}


def perturb_scales(model: torch.nn.Module, seed: int) -> None:
    """Move every 1-D parameter/buffer that starts as all-0 or all-1 (norm weights, router scales, layer
    scalars, correction biases) to random values near its start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dim() != 1 or not t.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            if torch.all(t == 1) or torch.all(t == 0):
                t.add_(0.3 * torch.randn(t.shape, generator=g))


def build(table: dict, family: str, path: Path, seed: int = 0, **overrides):
    """Make, perturb and save a random model of ``family``; returns the HF model (fp32, eval)."""
    import transformers

    cfg_name, model_name, kw = table[family]
    cfg = getattr(transformers, cfg_name)(**{**kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    perturb_scales(model, seed)
    model.save_pretrained(str(path))
    return model


def prompts(lengths=(5, 19, 27), seed: int = 1) -> list[list[int]]:
    """Random prompt ids in [3, VOCAB) (clear of bos/eos/pad)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int] | None, n: int, inputs_embeds: torch.Tensor | None = None):
    """transformers' greedy ids [n] and raw logits [n, V] (EOS ignored); from ids or from inputs_embeds [L, H]."""
    model.generation_config.eos_token_id = None  # sparrow runs with ignore_eos
    kw = dict(max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None)
    if inputs_embeds is not None:
        out = model.generate(inputs_embeds=inputs_embeds[None], **kw)
        ids = out.sequences[0, -n:].tolist()
    else:
        out = model.generate(torch.tensor([prompt]), **kw)
        ids = out.sequences[0, len(prompt):].tolist()
    return ids, torch.cat(out.logits, dim=0).float()


def compare(hf_ids, hf_logits, out, tie_gap: float = TIE_GAP, atol: float = LOGPROB_ATOL) -> int:
    """Assert sparrow's completion ``out`` (ids, logprobs) matches up to the first near-tie; returns the
    number of steps compared."""
    n = 0
    for step, want in enumerate(hf_ids):
        top2 = hf_logits[step].topk(2).values
        if float(top2[0] - top2[1]) < tie_gap:
            break
        got = out.token_ids[step]
        assert got == want, f"step {step}: sparrow {out.token_ids} != transformers {hf_ids}"
        if out.logprobs is not None:
            ref = float(torch.log_softmax(hf_logits[step], -1)[want])
            assert abs(out.logprobs[step][got].logprob - ref) < atol, (step, out.logprobs[step][got], ref)
        n += 1
    return n
