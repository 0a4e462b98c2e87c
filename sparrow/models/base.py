"""The causal-LM skeleton every architecture shares: embedding -> decoder layers -> final norm -> LM head.

A model file supplies its decoder layer class; this module holds the rest and the weight-name table
(``docs/architecture.md``, "Adding a model family"): checkpoint names stay HF's, packed projections are
declared in ``packed_modules``, per-expert tensors (``experts.N.gate_proj.<suffix>`` / Mixtral's
``w1``/``w3``/``w2``) map onto the stacked
``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] by ``EXPERT_TENSORS`` (a fused 3-D
checkpoint tensor of the same name loads whole), and ``renames`` maps older module names. Which suffixes an
expert layer takes (``weight``, a format's scales) and the parameters they fill come from the layer's weight
format (``FusedMoE.quant_method.checkpoint_tensors``).
Shapes: R = rows of the step, H = hidden, V = vocab, S' = rows whose logits are computed.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from sparrow.config import ModelConfig
from sparrow.layers.embedding import VocabEmbedding
from sparrow.layers.forward_batch import ForwardBatch
from sparrow.layers.logits import LogitsProcessor, TableLMHeadMethod, gather_logits
from sparrow.layers.mlp import GatedMLP
from sparrow.layers.moe import FusedMoE, MoEBlock
from sparrow.layers.router import Router
from sparrow.layers.norm import RMSNorm

# per-expert checkpoint tensor ``experts.N.<name>.weight`` -> (stacked parameter, row block)
EXPERT_TENSORS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0),  # Mixtral / MiniMax names
}
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(\w+)$")  # experts.N.<tensor>.<suffix>
_FUSED_EXTRA = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_\w+)$")  # experts.<stacked><suffix>


def make_experts(config: ModelConfig, dtype: torch.dtype) -> FusedMoE:
    """The stacked routed experts of one layer (their weight format loads fused 3-D and per-expert tensors)."""
    return FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size, config.hidden_act,
                    pair_threshold=config.moe_pair_threshold, params_dtype=dtype)


def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """The feed-forward block of layer ``layer_idx``: a routed MoEBlock (router, stacked experts, optional
    sigmoid-gated shared expert) on MoE layers, else a dense GatedMLP. forward(x [R, H]) -> [R, H]."""
    if not config.is_moe_layer(layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        bias=config.get("mlp_bias", False), dtype=dtype)
    gate = Router(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.router_scoring,
                  config.norm_topk_prob, config.router_correction_bias, config.n_group, config.topk_group,
                  config.routed_scaling_factor, params_dtype=dtype)
    shared = None
    if config.shared_expert_intermediate_size:
        shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, dtype=dtype)
    return MoEBlock(gate, make_experts(config, dtype), shared, shared_expert_gate=shared is not None)


class DecoderModel(nn.Module):
    """HF ``model.``: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, layer_cls, dtype: torch.dtype):
        super().__init__()
        scale = config.hidden_size**0.5 if config.is_gemma else None
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale, dtype)
        self.layers = nn.ModuleList(layer_cls(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kind=config.norm_kind, dtype=dtype)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids, batch.soft_embeds, batch.soft_mask)
        if getattr(self.layers[0], "chains_norms", False):
            # each layer returns its output and the next norm of it, computed in its closing kernel
            normed = self.layers[0].input_layernorm(x)
            for i, layer in enumerate(self.layers):
                next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                x, normed = layer(x, normed, batch, next_norm)
            return normed
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """forward(batch: ForwardBatch of R rows) -> hidden [R, H]; compute_logits(hidden [S', H]) -> [S', V] fp32."""

    layer_cls: type = None
    # checkpoint module name -> (packed module name, shard index)
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint name prefixes that are not part of the text decoder (skipped with a log line)
    skip_prefixes: tuple[str, ...] = ()
    # checkpoint prefix -> sparrow prefix (e.g. multimodal checkpoints nest the text model)
    prefix_map: dict[str, str] = {}
    # substring renames applied after prefix_map (older checkpoint module names -> HF 5 names)
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_cls, dtype)
        if not config.tie_word_embeddings:  # a vocab table of its own weight format, read by logits() only
            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.logits_processor = LogitsProcessor(config.final_logit_softcapping)
        self.lm_head_method = TableLMHeadMethod()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    @property
    def lm_table(self) -> VocabEmbedding:
        """The vocab table the logits read: the embedding when tied, else ``lm_head``."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    @property
    def lm_weight(self) -> torch.Tensor:
        """The LM table's float weight [V, H] (a float-table format's; ``QuantizedLMHeadMethod`` copies it)."""
        return self.lm_table.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S', H] -> fp32 logits [S', V] (vocab-parallel: this rank's [S', V'] gathered over the ranks)."""
        return self.logits_processor(gather_logits(self.lm_head_method.apply(self, hidden), self.config.vocab_size))

    def quantize_lm_head(self, method) -> None:
        """Compute the logits with ``method`` (``layers.logits.QuantizedLMHeadMethod`` on a format's
        ``get_lm_head_linear_method``) from now on; it builds what it needs from the loaded LM weight (``process_weights_after_loading``)."""
        method.process_weights_after_loading(self)
        self.lm_head_method = method

    def _expert_tensor(self, experts: str, suffix: str, stacked: str, fused: bool) -> str | None:
        """The parameter of expert layer ``experts`` that a checkpoint tensor with ``suffix`` (per expert) or
        fused suffix (``fused``) of ``stacked`` fills, by the layer's weight format; None when it takes none."""
        try:
            table = self.get_submodule(experts).quant_method.checkpoint_tensors
        except AttributeError:  # no such module, or not an expert layer
            return None
        for per_expert, fused_suffix, stacked_name, param in table:
            if stacked_name == stacked and (fused_suffix if fused else per_expert) == suffix:
                return param
        return None

    def resolve_weight(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) for a checkpoint tensor name; None for tensors outside the text
        decoder (skipped). Shard ids index packed projections (``packed_modules``)."""
        for src, dst in self.prefix_map.items():
            if name.startswith(src):
                name = dst + name[len(src):]
                break
        if name.startswith(self.skip_prefixes) or name.endswith("rotary_emb.inv_freq"):
            return None
        if self.config.tie_word_embeddings and name.startswith("lm_head."):
            return None
        for src, dst in self.renames:
            name = name.replace(src, dst)
        m = _PER_EXPERT.match(name)
        if m and m.group(3) in EXPERT_TENSORS:  # experts.N.gate_proj.weight -> experts.gate_up_proj[N, :I]
            stacked, block = EXPERT_TENSORS[m.group(3)]
            param = self._expert_tensor(m.group(1), m.group(4), stacked, fused=False)
            return (f"{m.group(1)}.{param}", (int(m.group(2)), block)) if param else (name, None)
        m = _FUSED_EXTRA.match(name)  # e.g. experts.gate_up_proj_scale_inv -> experts.w13_scale
        if m:
            param = self._expert_tensor(m.group(1), m.group(3), m.group(2), fused=True)
            return (f"{m.group(1)}.{param}", None) if param else (name, None)
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules:
                packed, shard = self.packed_modules[part]
                return ".".join(parts[:i] + [packed] + parts[i + 1:]), shard
        return name, None

    def checkpoint_name(self, name: str, checkpoint_names=()) -> str:
        """A parameter or module path of this model as a checkpoint with tensors ``checkpoint_names`` spells
        it: the ``prefix_map`` entry those names use, inverted (a multimodal Gemma 4 checkpoint nests the text
        model under ``model.language_model.``); unchanged when none does."""
        for src, dst in sorted(self.prefix_map.items(), key=lambda kv: len(kv[1]), reverse=True):
            if name.startswith(dst) and any(n.startswith(src) for n in checkpoint_names):
                return src + name[len(dst):]
        return name

    def describe_shard(self, pname: str, shard, checkpoint_names=()) -> tuple[str, tuple[int, ...]]:
        """(checkpoint tensor name, its expected shape) for shard ``shard`` of parameter ``pname``, as HF
        names it in a checkpoint with tensors ``checkpoint_names`` (for the missing-tensor error)."""
        param = self.get_parameter(pname)
        module_name, _, leaf = pname.rpartition(".")
        if hasattr(param, "expert_blocks"):  # stacked experts: name the per-expert tensor and the fused one
            expert, block = shard
            rows = param.shape[1] // param.expert_blocks
            table = self.get_submodule(module_name).quant_method.checkpoint_tensors
            suffix, fused_suffix, stacked = next((t[:3] for t in table if t[3] == leaf), ("weight", "", leaf))
            hf_module = self.checkpoint_name(module_name, checkpoint_names) + "."
            for src, dst in self.renames:  # back to the checkpoint's module names (Mixtral's block_sparse_moe)
                hf_module = hf_module.replace(dst, src)
            hf_module = hf_module[:-1]
            w_names = any("block_sparse_moe" in src for src, _ in self.renames)  # Mixtral / MiniMax: w1 / w3 / w2
            part = {("gate_up_proj", 0): "w1" if w_names else "gate_proj", ("gate_up_proj", 1): "w3" if w_names
                    else "up_proj", ("down_proj", 0): "w2" if w_names else "down_proj"}.get((stacked, block), stacked)
            fused = f"{hf_module}.{stacked}{fused_suffix}"
            return (f"{hf_module + f'.{expert}.{part}.{suffix}'!r} (or the fused {fused!r} {tuple(param.shape)})",
                    (rows, param.shape[2]))
        module = self.get_submodule(module_name)
        sizes = getattr(module, "output_sizes", None)
        packed = [src for src, (dst, idx) in self.packed_modules.items() if module_name.endswith(dst) and idx == shard]
        if sizes is not None and packed:
            base = self.checkpoint_name(module_name[: -len(module_name.rpartition(".")[2])], checkpoint_names)
            shape = module.quant_method.shard_shape(module, leaf, sizes[shard])
            return repr(f"{base}{packed[0]}.{leaf}"), shape
        return f"{self.checkpoint_name(pname, checkpoint_names)!r} shard {shard!r}", tuple(param.shape)

    def attention_layers(self):
        """Every Attention module, in layer order (the ModelRunner binds a KV cache to each)."""
        from sparrow.layers.attention import Attention

        return [m for m in self.modules() if isinstance(m, Attention)]
