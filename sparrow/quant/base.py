"""What a weight format is (``docs/architecture.md``, "The quant-method contract"): a ``QuantizationConfig`` (one
per model) that gives a method object for each dense ``Linear``, each routed-expert layer (``FusedMoE``), each vocab
table (``VocabEmbedding``: the token embedding, and an untied LM head) and the quantized LM head. A method owns its layer's weight parameters: ``create_weights`` allocates them (with their checkpoint
loaders), ``process_weights_after_loading`` finishes them once every tensor is in (on-load quantization, kernel
layouts), ``apply`` computes the layer. Model code calls the layer; the layer calls its method; nothing outside
``sparrow.quant`` names a format. The unquantized path is a method object too (``UnquantizedConfig``).

Choosing the methods: the loader builds the model inside ``with quant_config_scope(cfg):``; each Linear /
FusedMoE / VocabEmbedding created there takes ``cfg.get_method(kind, None)``. A layer does not know its own name while it is
built, so afterwards ``bind_quant_config(model, cfg)`` walks ``named_modules()``, stores each layer's
``prefix`` and gives the layers the config treats differently by name (routers, ignored layers) their own
method, before any checkpoint tensor is read. A method that cannot take a layer's shape raises naming the layer:
while the layer is unnamed (built, not yet bound) it sets ``layer.quant_unnamed`` and creates nothing, and
``bind_quant_config`` creates the weights again once the name is known (or gives the layer the float method
its config names). A context variable rather than a constructor argument keeps the
model files and the shared blocks (attention, MLP) free of quantization plumbing.

Shapes: R = rows, K = in features, N = out features, H = hidden, E = experts, I = expert width, V = vocab.
"""
from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.errors import InvalidRequestError

KV_CACHE_SCALES = (".k_scale", ".v_scale")
"""Suffixes of the per-layer KV-cache scales of a checkpoint exported for an FP8 KV cache (ModelOpt:
``self_attn.k_proj.k_scale``; compressed-tensors: ``self_attn.k_scale``)."""

LAYER_KINDS = ("linear", "moe", "embedding")
"""``quant_kind`` of the layers that hold a method: ``sparrow.layers.linear.Linear``, ``layers.moe.FusedMoE``,
``layers.embedding.VocabEmbedding``."""


def set_layer_method(layer: nn.Module, method, device: torch.device | None = None) -> None:
    """Give ``layer`` (a Linear, FusedMoE or VocabEmbedding) the weight method ``method``: drop the parameters its previous method
    created (named in ``layer._quant_param_names``), then let ``method`` create its own in ``layer.params_dtype`` on
    ``device`` (default: the device of the dropped ones; the current default device when there were none)."""
    for name in getattr(layer, "_quant_param_names", ()):
        param = layer._parameters.pop(name)
        device = device or param.device
    before = set(layer._parameters)
    layer.quant_method = method
    layer.quant_unnamed = False
    with torch.device(device) if device is not None else contextlib.nullcontext():
        method.create_weights(layer, layer.params_dtype)
    layer._quant_param_names = [n for n in layer._parameters if n not in before]


def mark_unnamed(layer: nn.Module) -> bool:
    """For a method whose layer's shape it cannot take: True (and ``layer.quant_unnamed`` set) while the layer is
    built but not yet named, so that the method creates nothing and ``bind_quant_config`` calls it again by name
    (module doc); False once named, when the method raises naming ``layer.prefix``."""
    if layer.prefix:
        return False
    layer.quant_unnamed = True
    return True


class LinearMethodBase:
    """Weights and compute of a ``Linear`` (y [R, N] = x [R, K] @ W.T + b). ``dtype`` of create_weights is the
    model dtype (activations, bias). Loaders: each parameter's ``weight_loader(param, tensor, shard_id, name)``
    (the Linear's generic one unless the method binds its own)."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (+ bias)."""
        raise NotImplementedError

    def shard_shape(self, layer: nn.Module, param_name: str, rows: int) -> tuple[int, ...]:
        """Shape of the checkpoint tensor that fills ``rows`` output rows of ``param_name`` (one shard of a
        packed layer), for the missing-tensor message."""
        return (rows,) + tuple(getattr(layer, param_name).shape[1:])


class FusedMoEMethodBase:
    """Weights and compute of a ``FusedMoE`` (stacked experts, gate|up [E, 2I, H], down [E, H, I]).

    ``checkpoint_tensors``: (per-expert suffix, fused suffix, stacked name, layer parameter) for each tensor a
    checkpoint holds: ``experts.N.gate_proj.<per-expert suffix>`` fills rows of ``<layer parameter>`` of
    ``<stacked name>`` ``gate_up_proj``, and the fused ``experts.gate_up_proj<fused suffix>`` fills all of it.
    The weight-name table (``sparrow.models.base``) reads it."""

    checkpoint_tensors: ClassVar[tuple[tuple[str, str, str, str], ...]] = (
        ("weight", "", "gate_up_proj", "gate_up_proj"), ("weight", "", "down_proj", "down_proj"))

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              reduce: bool = True, lora=None) -> torch.Tensor:
        """x [R, H], topk_weights / topk_ids [R, K'] -> [R, H] in x's dtype, or the unweighted per-pair outputs
        [R K', H] with ``reduce=False`` (see ``FusedMoE``). ``lora``: the step's per-pair adapter deltas
        (``sparrow.layers.lora_buffers.ExpertDelta``) or None; a format adds gate_up's before the activation and
        down's before the weighted reduce (the float paths of ``sparrow.kernels.moe.moe`` take it as is)."""
        raise NotImplementedError


class EmbeddingMethodBase:
    """Weights of a vocab table [V, H] (``VocabEmbedding``: ``num_embeddings`` V, ``embedding_dim`` H): its rows
    looked up for token ids, and the logits of hidden states against it (the LM head, tied or not; vLLM's
    ``VocabParallelEmbedding`` / ``ParallelLMHead`` methods alike). ``dtype`` of create_weights is the model dtype."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] int64 in [0, V) -> rows [R, H] in the model dtype. An id >= V fails as indexing a float table
        does (IndexError on CPU, a device-side assert on CUDA)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in hidden's dtype (hidden @ table.T)."""
        raise NotImplementedError


class UnquantizedEmbeddingMethod(EmbeddingMethodBase):
    """Every format's default table (``QuantizationConfig.get_embedding_method``): ``weight`` [V, H] in the model
    dtype (vocab-parallel: this rank's [V', H] rows); rows by indexing, logits by ``F.linear``."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        start, rows = layer.vocab_range  # rows < V: this rank's share (vocab-parallel)
        layer.weight = nn.Parameter(torch.empty(rows, layer.embedding_dim, dtype=dtype), requires_grad=False)
        if rows != layer.num_embeddings:
            from sparrow.quant.weight_loaders import vocab_shard_loader

            layer.weight.weight_loader, layer.weight.vocab_range = vocab_shard_loader, (start, rows)
            layer.weight.checkpoint_shape = (layer.num_embeddings, layer.embedding_dim)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.weight[ids]

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, layer.weight)


class QuantizationConfig:
    """A weight format and its per-model settings. Subclasses register themselves with
    ``sparrow.quant.registry.register_quantization`` under ``name``, the checkpoint's
    ``quantization_config.quant_method`` and the ``quantization=`` value."""

    name: ClassVar[str] = ""
    """Registry name: HF ``quant_method`` and ``LLM(quantization=...)`` / ``--quantization`` value."""
    title: ClassVar[str] = ""
    """How messages name the format (e.g. "FP8")."""
    help: ClassVar[str] = ""
    """One line for ``--quantization``'s help: what ``quantization=name`` does."""
    checkpoint_tensor_kinds: ClassVar[dict[str, str]] = {}
    """Checkpoint tensor-name suffix -> what it is ("an FP8 block scale"), for the unused-tensor message."""

    kv_cache_scales: bool = False
    """The checkpoint's quantization_config declares an FP8 KV cache (ModelOpt ``kv_cache_quant_algo``,
    compressed-tensors ``kv_cache_scheme``): its ``KV_CACHE_SCALES`` tensors are not weights (``skips_tensor``)."""

    hf_quant_methods: ClassVar[tuple[str, ...]] = ()
    """More ``quantization_config.quant_method`` values this format may load (besides ``name``), each only where
    ``claims_hf`` says so (e.g. "compressed-tensors", which several formats share)."""

    @classmethod
    def claims_hf(cls, qc: dict) -> bool:
        """Whether a checkpoint's ``quantization_config`` ``qc`` is in this format (default: its ``quant_method``
        is ``name`` or one of ``hf_quant_methods``); ``from_hf`` then reads it or says what it lacks."""
        return qc.get("quant_method") in (cls.name, *cls.hf_quant_methods)

    @classmethod
    def from_hf(cls, qc: dict) -> "QuantizationConfig":
        """From config.json's ``quantization_config``. Raises ModelLoadError for settings the format lacks."""
        raise NotImplementedError

    @classmethod
    def for_quantization(cls) -> "QuantizationConfig":
        """The config of ``quantization=name`` on a float checkpoint (quantize while loading). Raises
        InvalidRequestError where the format cannot quantize at load."""
        raise InvalidRequestError(f"quantization={cls.name!r}: {cls.title or cls.name} weights load from "
                                  "checkpoints only (sparrow cannot quantize to it at load)")

    @staticmethod
    def declares_kv_cache(qc: dict) -> bool:
        """Whether a checkpoint's ``quantization_config`` (or ModelOpt's ``quantization`` object in it) declares an
        FP8 KV cache: ``kv_cache_quant_algo`` (ModelOpt) or ``kv_cache_scheme`` (compressed-tensors) set."""
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        return bool(inner.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme"))

    def skips_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is not a weight: the KV-cache scales of ``kv_cache_scales``, which the
        loader hands to ``sparrow.kv_cache.checkpoint`` (used by an FP8 KV cache, ignored by a model-dtype one)."""
        return self.kv_cache_scales and name.endswith(KV_CACHE_SCALES)

    def for_model(self, model: nn.Module) -> "QuantizationConfig":
        """This config with module names resolved against ``model`` (called once it is built)."""
        return self

    def get_linear_method(self, prefix: str | None) -> LinearMethodBase:
        """The method of the Linear named ``prefix`` (None: not known yet)."""
        raise NotImplementedError

    def get_moe_method(self, prefix: str | None) -> FusedMoEMethodBase:
        """The method of the FusedMoE named ``prefix`` (None: not known yet)."""
        raise NotImplementedError

    def get_embedding_method(self, prefix: str | None) -> EmbeddingMethodBase:
        """The method of the vocab table named ``prefix`` (``model.embed_tokens``, an untied ``lm_head``; None: not
        known yet). Default: the table in the model dtype (``UnquantizedEmbeddingMethod``)."""
        return UnquantizedEmbeddingMethod()

    def get_lm_head_linear_method(self) -> LinearMethodBase | None:
        """The linear method of the LM head under ``quantize_lm_head=True``: the loaded LM weight is copied into a
        ``Linear`` of this method (``sparrow.layers.logits.QuantizedLMHeadMethod``); None where the format has
        none (the loader then names the formats that have one)."""
        return None

    def get_method(self, kind: str, prefix: str | None):
        """``get_linear_method`` / ``get_moe_method`` / ``get_embedding_method`` by the layer's ``quant_kind``."""
        if kind not in LAYER_KINDS:
            raise ValueError(f"unknown layer kind {kind!r} (known: {LAYER_KINDS})")
        return getattr(self, f"get_{kind}_method")(prefix)
