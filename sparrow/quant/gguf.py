"""The GGUF format: a ``.gguf`` file's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K) stay packed on
the device and the kernels dequantize them in registers (``sparrow.kernels.gemm.gguf``, ``kernels.moe.gguf_moe``).

A GGUF file loads in this format unless ``quantization=`` names another one (then the loader dequantizes every
tensor to float and that format re-quantizes it: lossy twice). The loader (``sparrow.loader.gguf``) yields each
quantized tensor as its packed rows, uint8 [rows, K // B * T] (the file's bytes; B elements of T bytes a block),
with the tensor's ggml type in the attribute ``ggml_type``; a parameter that takes packed rows says so with
``gguf_blocks = True`` and every other parameter (norms, routers, biases) gets the tensor dequantized
(``logical_shape``). A tensor stored as F32 / F16 / BF16 arrives as float and is kept in the model dtype.

Linear: each shard (q, k, v of ``qkv_proj``) may have its own type (a Q4_K_M file mixes Q4_K, Q5_0, Q6_K, Q8_0);
after loading, consecutive shards of one type are concatenated into one segment and ``apply`` runs one kernel a
segment. Experts: ``gate_up_proj`` [E, 2I, H // B * T] and ``down_proj`` [E, H, I // B * T], one type each
(gate and up must share theirs). Vocab tables (the token embedding, an untied ``output.weight``): one segment
[V, H // B * T]; a lookup dequantizes only the rows it reads, the logits run the linears' kernel on the same bytes
(tied: the embedding's). Shapes: R rows, K in features, N out features, E experts, H hidden, I expert width, V vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.common.gguf_blocks import block_bytes, dequantize
from sparrow.quant.base import EmbeddingMethodBase, FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
from sparrow.quant.registry import register_quantization


def is_packed(t: torch.Tensor) -> bool:
    """Whether loader tensor ``t`` holds packed GGUF rows (it carries ``ggml_type``)."""
    return getattr(t, "ggml_type", None) is not None


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The float shape of packed rows ``t`` [..., K // B * T] of type ``t.ggml_type``: [..., K]."""
    elems, nbytes = block_bytes(t.ggml_type)
    return (*t.shape[:-1], t.shape[-1] // nbytes * elems)


def dequantize_packed(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """Packed rows -> float32 of ``logical_shape(t)`` (bit-exact with gguf-py); a float tensor as it is."""
    if not is_packed(t):
        return t
    return dequantize(t, t.ggml_type, logical_shape(t), name=name)


def _placeholder(loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
    p.weight_loader, p.gguf_blocks = loader, True
    return p


def _type_name(ggml_type: int | None) -> str:
    from gguf.constants import GGMLQuantizationType

    return "float" if ggml_type is None else GGMLQuantizationType(ggml_type).name


def _segments_matmul(layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
    """x2 [R, K] @ W.T -> [R, N] in x2's dtype over ``layer.gguf_segments`` (one kernel a segment, concatenated)."""
    from sparrow.kernels.gemm.gguf import gguf_linear

    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()  # the kernels read K with unit stride
    outs = []
    for ggml_type, _, buf in layer.gguf_segments:
        w = getattr(layer, buf)
        outs.append(F.linear(x2, w) if ggml_type is None else gguf_linear(x2, w, ggml_type))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class GGUFLinearMethod(LinearMethodBase):
    """A Linear on packed GGUF rows: ``weight`` is a placeholder whose loader keeps each shard as it comes;
    ``process_weights_after_loading`` makes the segments ``layer.gguf_segments`` = [(ggml type or None for a
    float shard, rows, buffer name)], each buffer uint8 [rows, K // B * T] (float: [rows, K] in the model dtype)."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.gguf_shards = {}

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            rows = layer.out_features if shard_id is None else layer.output_sizes[shard_id]
            shape = logical_shape(loaded) if is_packed(loaded) else tuple(loaded.shape)
            if shape != (rows, layer.in_features):
                raise ModelLoadError(f"tensor {name!r} has shape {shape}, expected {(rows, layer.in_features)}")
            kept = loaded.contiguous() if is_packed(loaded) else loaded.to(layer.params_dtype)
            layer.gguf_shards[0 if shard_id is None else shard_id] = (getattr(loaded, "ggml_type", None), kept)

        layer.weight = _placeholder(load)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = [layer.gguf_shards[i] for i in sorted(layer.gguf_shards)]
        device = layer.weight.device
        segments: list[list] = []
        for ggml_type, t in shards:
            if segments and segments[-1][0] == ggml_type:
                segments[-1][1].append(t)
            else:
                segments.append([ggml_type, [t]])
        layer.gguf_segments = []
        for i, (ggml_type, parts) in enumerate(segments):
            data = torch.cat(parts).to(device) if len(parts) > 1 else parts[0].to(device, copy=True)
            layer.register_buffer(f"gguf_weight_{i}", data.contiguous(), persistent=False)
            layer.gguf_segments.append((ggml_type, data.shape[0], f"gguf_weight_{i}"))
        del layer.gguf_shards

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = _segments_matmul(layer, x2)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def shard_shape(self, layer: nn.Module, param_name: str, rows: int) -> tuple[int, ...]:
        return (rows, layer.in_features)


class GGUFMoEMethod(FusedMoEMethodBase):
    """Routed experts on packed GGUF rows: ``gate_up_proj`` uint8 [E, 2I, H // B * T] and ``down_proj``
    [E, H, I // B * T] (types ``layer.gate_up_type`` / ``layer.down_type``), filled one expert slice at a time as the
    loader yields them (shard id (expert, block)); apply is ``sparrow.kernels.moe.gguf_moe.gguf_fused_moe``."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        h, i = layer.hidden_size, layer.intermediate_size
        for pname, rows, cols, blocks in (("gate_up_proj", 2 * i, h, 2), ("down_proj", h, i, 1)):
            param = _placeholder(self._loader(layer, pname, rows // blocks, cols))
            param.expected_shards = [(e, b) for e in range(layer.num_experts) for b in range(blocks)]
            param.checkpoint_shape = (rows // blocks, cols)
            setattr(layer, pname, param)
        layer.gguf_stacks = {}

    @staticmethod
    def _loader(layer: nn.Module, pname: str, rows: int, cols: int):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if shard_id is None:
                raise ModelLoadError(f"tensor {name!r}: GGUF experts load one expert slice at a time")
            expert, block = shard_id
            shape = logical_shape(loaded) if is_packed(loaded) else tuple(loaded.shape)
            if shape != (rows, cols):
                raise ModelLoadError(f"tensor {name!r} has shape {shape}, expected {(rows, cols)}")
            if not is_packed(loaded):
                raise ModelLoadError(f"tensor {name!r} is stored as float; sparrow's GGUF experts take quantized "
                                     "blocks (load the file with quantization=None after converting it with "
                                     "quantized experts, or pass quantization='fp8')")
            stack = layer.gguf_stacks.get(pname)
            if stack is None:
                stack = (loaded.ggml_type, torch.empty(layer.num_experts, rows * (2 if pname == "gate_up_proj" else 1),
                                                       loaded.shape[-1], dtype=torch.uint8, device=param.device))
                layer.gguf_stacks[pname] = stack
            if stack[0] != loaded.ggml_type:
                raise ModelLoadError(f"tensor {name!r} is {_type_name(loaded.ggml_type)}, but the other slices of "
                                     f"{layer.prefix}.{pname} are {_type_name(stack[0])}: sparrow's GGUF experts take "
                                     "one type per projection (gate and up alike)")
            stack[1][expert, block * rows:(block + 1) * rows].copy_(loaded)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for pname in ("gate_up_proj", "down_proj"):
            ggml_type, data = layer.gguf_stacks[pname]
            setattr(layer, pname, nn.Parameter(data, requires_grad=False))
            setattr(layer, pname.replace("_proj", "_type"), ggml_type)
        del layer.gguf_stacks

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              reduce: bool = True, lora=None) -> torch.Tensor:
        from sparrow.kernels.moe.gguf_moe import gguf_fused_moe

        return gguf_fused_moe(x, layer.gate_up_proj, layer.gate_up_type, layer.down_proj, layer.down_type,
                              topk_weights, topk_ids, layer.activation, pair_threshold=layer.pair_threshold,
                              swiglu_limit=layer.swiglu_limit, reduce=reduce, lora=lora)


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """A vocab table on a GGUF file's rows: ``weight`` is a placeholder whose loader keeps the tensor as it comes;
    after loading the table is one segment ``layer.gguf_segments`` = [(ggml type or None, V, "gguf_weight_0")], its
    buffer uint8 [V, H // B * T] (a float file type: [V, H] in the model dtype; vocab-parallel: this rank's V' rows,
    zero blocks past V, which dequantize to zero rows). ``embedding``: the rows' blocks
    gathered and dequantized (``gguf_blocks.dequantize``: bit-exact with gguf-py), cast to the model dtype as the
    float table would hold them; torch ops on the device with no host sync (a CUDA graph captures it).
    ``apply``: the linears' GGUF kernel (``gguf_linear``) on the same bytes."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        shape = (layer.num_embeddings, layer.embedding_dim)

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            got = logical_shape(loaded) if is_packed(loaded) else tuple(loaded.shape)
            if got != shape:
                raise ModelLoadError(f"tensor {name!r} has shape {got}, expected {shape}")
            kept = loaded.contiguous() if is_packed(loaded) else loaded.to(layer.params_dtype)
            start, rows = layer.vocab_range  # vocab-parallel: this rank's rows (whole rows of blocks), zeros past V
            if rows != shape[0]:
                part = kept[start:start + rows]
                kept = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            layer.gguf_table = (getattr(loaded, "ggml_type", None), kept)

        layer.weight = _placeholder(load)
        layer.weight.checkpoint_shape = shape  # for the missing-tensor message

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        ggml_type, t = layer.gguf_table
        layer.register_buffer("gguf_weight_0", t.to(layer.weight.device, copy=True).contiguous(), persistent=False)
        layer.gguf_segments = [(ggml_type, t.shape[0], "gguf_weight_0")]
        del layer.gguf_table

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        ggml_type, _, buf = layer.gguf_segments[0]
        rows = getattr(layer, buf)[ids]  # [R, H // B * T]: an id >= V raises here, as a float table's index does
        if ggml_type is None:
            return rows
        return dequantize(rows, ggml_type, (*ids.shape, layer.embedding_dim)).to(layer.params_dtype)

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _segments_matmul(layer, hidden)


@register_quantization
class GGUFConfig(QuantizationConfig):
    """A GGUF file's own blocks, kept packed (module doc). Chosen by the loader for a ``.gguf`` file loaded with
    ``quantization=None`` (or ``"gguf"``); it cannot quantize a float checkpoint."""

    name = "gguf"
    title = "GGUF"
    help = "a .gguf file's quantized blocks, kept packed (the default for .gguf files)"

    def get_linear_method(self, prefix: str | None) -> LinearMethodBase:
        return GGUFLinearMethod()

    def get_moe_method(self, prefix: str | None) -> FusedMoEMethodBase:
        return GGUFMoEMethod()

    def get_embedding_method(self, prefix: str | None) -> EmbeddingMethodBase:
        return GGUFEmbeddingMethod()


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of packed GGUF weights, bytes of every other parameter and buffer) of a loaded model."""
    packed = other = 0
    for mod in model.modules():
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            n = t.numel() * t.element_size()
            if name.startswith("gguf_weight_") or (t.dtype == torch.uint8 and getattr(mod, "gate_up_type", None)
                                                  is not None):
                packed += n
            else:
                other += n
    return packed, other
