"""Linear layers whose weight format is a quantization method object
(``docs/architecture.md``, "The quant-method contract").

Shapes: R = rows, K = in_features, N = out_features. Weights are stored [N, K] as in nn.Linear / HF.
A packed linear (``qkv_proj``, ``gate_up_proj``) concatenates several checkpoint tensors along N; the
loader fills each shard through ``weight_loader(param, tensor, shard_id, name)``.

Choosing the weight format: model code builds every Linear without naming a format; a Linear
built inside ``sparrow.quant.quant_config_scope(cfg)`` takes ``cfg.get_linear_method(None)`` and
``sparrow.quant.bind_quant_config`` later gives it the method for its name (see ``sparrow.quant.base``).
Routers (``nn.Linear``) and norms are not ``Linear`` and stay in the model dtype; the embedding and an untied
LM head are vocab tables with a method of their own (``sparrow.layers.embedding.VocabEmbedding``).

Tensor parallelism (``parallel=``, vLLM's scheme; ``sparrow.distributed`` gives this rank r of T when the layer is
built): "column" holds this rank's rows of every packed shard (shard i of full size N_i: rows [r N_i / T,
(r + 1) N_i / T), or the caller's ``shard_ranges``, e.g. replicated KV heads) and returns its slice [R, N / T] of
the output; "row" holds columns [r K / T, (r + 1) K / T) and takes that slice of x, its partial products are summed
over the ranks by one all-reduce (``reduce_results=False`` leaves the partial sum to the caller), and the bias is
added once (rank 0 loads it, the others hold zeros). Each checkpoint tensor is narrowed to the rank's share before
the format's loader sees it (``sparrow.quant.weight_loaders.narrow_shard``), so every format loads a shard as it
loads a whole layer of the shard's shape; a share off the format's block boundaries raises ModelLoadError naming
the tensor. With one rank a parallel Linear is the plain one.
"""
from __future__ import annotations


import torch
from torch import nn

from sparrow.distributed import get_tp
from sparrow.errors import ModelLoadError
from sparrow.layers.lora_buffers import add_linear_delta
from sparrow.quant.base import LinearMethodBase, set_layer_method
from sparrow.quant.scope import current_quant_config
from sparrow.quant.weight_loaders import narrow_shard

PARALLEL_MODES = (None, "column", "row")


class Linear(nn.Module):
    """y [R, N] = x [R, K] @ W.T (+ bias), computed by ``quant_method``.

    ``output_sizes`` splits N into shards for packed projections (e.g. [q, k, v] sizes); each shard is
    loaded from its own checkpoint tensor by index. ``parallel`` (module doc): None, "column" or "row";
    ``in_features`` / ``output_sizes`` are the full (checkpoint) sizes, ``self.in_features`` /
    ``self.output_sizes`` / ``self.out_features`` this rank's. ``shard_ranges`` (column only): (start, size) of this
    rank's rows in each shard's checkpoint tensor, instead of the even split. Raises ModelLoadError when a size
    does not split over the ranks."""

    quant_kind = "linear"
    lora = None
    """The adapter slots' buffers (``sparrow.layers.lora_buffers.LoRABuffers``) when LoRA is enabled."""

    def __init__(
        self,
        in_features: int,
        out_features: int | None = None,
        bias: bool = False,
        output_sizes: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        quant_method: LinearMethodBase | None = None,
        parallel: str | None = None,
        shard_ranges: list[tuple[int, int]] | None = None,
    ):
        super().__init__()
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"Linear: parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        full = list(output_sizes) if output_sizes else [out_features]
        self.full_output_sizes = list(full)
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.parallel = parallel if self.tp_size > 1 else None
        self.reduce_results = True
        self.shard_ranges = None  # column: (start, size) of this rank's rows in each shard's checkpoint tensor
        if self.parallel == "column":
            self.shard_ranges = list(shard_ranges) if shard_ranges else [
                (self.tp_rank * _split(n, self.tp_size, "output size"), n // self.tp_size) for n in full]
            full = [size for _, size in self.shard_ranges]
        elif self.parallel == "row":
            in_features = _split(in_features, self.tp_size, "input size")
        self.output_sizes = full
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.params_dtype = dtype
        self.prefix = ""
        self.bias = None
        self.set_quant_method(quant_method or current_quant_config().get_linear_method(None))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.num_shards = len(self.output_sizes)
            if self.parallel is not None:
                self.bias.weight_loader = self._sharded(self.weight_loader)
                self.bias.tp_sharded = True

    def set_quant_method(self, method) -> None:
        """(Re)create the weights with ``method``: drops the previous method's parameters (bias stays),
        allocates the new ones on the same device, binds loaders (a method's own loaders win)."""
        set_layer_method(self, method, self.bias.device if self.bias is not None else None)
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader
            p.num_shards = len(self.output_sizes)
            if self.parallel is not None and not getattr(p, "tp_sharded", False):
                p.weight_loader = self._sharded(p.weight_loader)
                p.tp_sharded = True

    def _sharded(self, inner):
        """``inner`` (a parameter's loader) fed with this rank's share of each checkpoint tensor (module doc)."""
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            inner(param, self.shard_tensor(param, loaded, shard_id, name), shard_id, name)

        return load

    def shard_tensor(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None,
                     name: str) -> torch.Tensor:
        """This rank's share of checkpoint tensor ``loaded`` (shard ``shard_id`` of a packed layer, or all of it)
        for ``param``; a row-parallel bias is zeros off rank 0 (added once). Raises ModelLoadError (``narrow_shard``)."""
        if self.parallel == "row":
            if param is self.bias:
                return loaded if self.tp_rank == 0 else torch.zeros_like(loaded)
            k = self.in_features
            return narrow_shard(param, loaded, "k", self.tp_rank * k, k, name)
        if shard_id is not None:
            return narrow_shard(param, loaded, "n", *self.shard_ranges[shard_id], name)
        if len(self.shard_ranges) == 1:
            return narrow_shard(param, loaded, "n", *self.shard_ranges[0], name)
        # a whole packed tensor: each shard's rows narrowed, then concatenated
        n_dim = getattr(param, "shard_layout", ((0, 1),))[0]
        parts, offset = [], 0
        for (start, size), full in zip(self.shard_ranges, self.full_output_sizes):
            parts.append(narrow_shard(param, loaded, "n", offset + start, size, name))
            offset += full
        out = torch.cat(parts, dim=n_dim[0] if n_dim is not None else 0)
        if hasattr(parts[0], "ggml_type"):
            out.ggml_type = parts[0].ggml_type
        return out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None, name: str) -> None:
        """Copy a checkpoint tensor (whole, or shard ``shard_id`` of a packed layer) into ``param``.

        Raises ModelLoadError naming the tensor when its shape does not fit."""
        if shard_id is None:
            target = param.data
        else:
            start = sum(self.output_sizes[:shard_id])
            target = param.data.narrow(0, start, self.output_sizes[shard_id])
        if tuple(loaded.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """x [R, K] -> [R, N]. ``batch``: the step's ForwardBatch (per-row facts such as adapter ids), when the
        caller runs inside a model step: rows with an adapter get its delta B (A x), added to the base output in
        the activation dtype whatever the weight format."""
        y = self.quant_method.apply(self, x)
        if self.lora is not None and batch is not None and batch.adapter_ids is not None:
            y = add_linear_delta(self.lora, x, y, batch.adapter_ids)
        if self.parallel == "row" and self.reduce_results:
            y = get_tp().all_reduce(y)
        return y


def _split(total: int, world: int, what: str) -> int:
    if total % world:
        raise ModelLoadError(f"a parallel linear's {what} ({total}) is not divisible by tensor_parallel_size={world}")
    return total // world
