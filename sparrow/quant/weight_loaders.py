"""Parameter-side weight loaders: the ``weight_loader(param, tensor, shard_id, name)`` a parameter carries,
which the generic loader (``sparrow.loader.weights.load_weights``) calls for each checkpoint tensor.

Stacked experts (``bind_expert_loaders``): ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] are filled
in place, one expert slice per checkpoint tensor as the tensors stream by (shard id (e, block): rows
block*I:(block+1)*I of expert e), or whole from a fused 3-D tensor; no second stacked copy is ever built.
The formats' expert methods make such parameters (``unquantized.stacked_expert_param``, ``on_load``).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.errors import ModelLoadError


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Copy a whole tensor into ``param`` (cast to its dtype); ModelLoadError on a shape mismatch."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def vocab_shard_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Copy this rank's rows ``param.vocab_range`` = (start, rows) of a [V, H] checkpoint table into ``param``
    [rows, H] (rows past V zeroed: vocab-parallel, ``sparrow.layers.embedding``). ModelLoadError on a misshaped
    tensor."""
    start, rows = param.vocab_range
    want = param.checkpoint_shape
    if tuple(loaded.shape) != tuple(want):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(want)}")
    have = max(0, min(rows, want[0] - start))
    param.data[:have].copy_(loaded[start:start + have])
    param.data[have:].zero_()


def expert_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
    """Load one (expert, block) slice of a stacked expert parameter, or the whole of it (shard id None);
    ModelLoadError for an expert past the parameter's or a misshaped tensor."""
    if shard_id is None:
        return default_weight_loader(param, loaded, None, name)
    expert, block = shard_id
    if expert >= param.shape[0]:
        raise ModelLoadError(f"tensor {name!r} names expert {expert}, but the model has {param.shape[0]} experts")
    rows = param.shape[1] // param.expert_blocks
    target = param.data[expert].narrow(0, block * rows, rows)
    if tuple(loaded.shape) != tuple(target.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def bind_expert_loaders(param: nn.Parameter, blocks: int) -> None:
    """Make a stacked expert parameter [E, blocks * rows, cols] loadable from per-expert tensors (shard id
    (expert, block), each [rows, cols]) or from one fused [E, blocks * rows, cols] tensor (shard id None)."""
    param.weight_loader = expert_loader
    param.expert_blocks = blocks
    param.expected_shards = [(e, b) for e in range(param.shape[0]) for b in range(blocks)]


# ---- tensor-parallel shards ------------------------------------------------------------------------------------
# A parallel layer (``sparrow.layers.linear.Linear(parallel=...)``, ``layers.moe.FusedMoE``) narrows each checkpoint
# tensor to its rank's share before the format's loader sees it, so every format loads a shard exactly as it loads
# a whole tensor of the shard's shape. Where the share lies in a tensor is the format's knowledge: its parameters
# say it with ``set_shard_layout`` (default: rows N on dim 0, columns K on dim 1, one element an index; a 1-D tensor is rows only).


def set_shard_layout(param: nn.Parameter, n: tuple[int, int] | None = (0, 1), k: tuple[int, int] | None = (-1, 1),
                     special: tuple | None = None) -> None:
    """Declare where the checkpoint tensor that ``param``'s loader takes holds the layer's output rows N (``n``) and
    input columns K (``k``): (dim, elements per index along it), or None where the tensor has no such dim (it is
    then whole on every rank). ``special``: ("shape",) for a tensor whose values are [N, K] (compressed-tensors'
    ``weight_shape``: rewritten to the shard's), ("g_idx", group) for GPTQ's group index per K column (rebased to
    the shard's first group). For stacked experts the dims are those of one expert's tensor."""
    param.shard_layout = (n, k, special)


def _gguf_block(t: torch.Tensor) -> tuple[int, int] | None:
    """(elements, bytes) of a block of GGUF packed rows ``t`` (their last dim is bytes); None for other tensors."""
    ggml_type = getattr(t, "ggml_type", None)
    if ggml_type is None:
        return None
    from sparrow.kernels.common.gguf_blocks import block_bytes

    return block_bytes(ggml_type)


def narrow_shard(param: nn.Parameter, loaded: torch.Tensor, axis: str, start: int, size: int, name: str,
                 dim_offset: int = 0) -> torch.Tensor:
    """Checkpoint tensor ``loaded`` narrowed to elements [start, start + size) of the layer's ``axis`` ("n": output
    rows, "k": input columns) by ``param``'s shard layout (``set_shard_layout``); ``dim_offset``: leading dims the
    layout does not count (a fused [E, ...] expert tensor: 1). A tensor without that dim, or of one element (a
    global scale), is returned whole. GGUF packed rows split their last (byte) dim on whole blocks. Raises
    ModelLoadError naming the tensor when the share does not start and end on the layout's block boundaries."""
    own = loaded.dim() - dim_offset  # dims of the layer's own tensor
    n, k, special = getattr(param, "shard_layout", ((0, 1), (1, 1) if own >= 2 else None, None))
    spec = n if axis == "n" else k
    if spec is None or loaded.numel() == 1 or own < 1:
        return loaded
    dim, per = spec
    dim = dim % own + dim_offset
    if special is not None and special[0] == "shape":  # values [N, K]: the shard's
        out = loaded.clone()
        out.reshape(-1)[0 if axis == "n" else 1] = size
        return out
    block, index_bytes = per, 1
    gguf = _gguf_block(loaded)
    if gguf is not None and dim == loaded.dim() - 1:  # bytes of (elements, bytes) blocks
        block, index_bytes = gguf
    if start % block or size % block:
        raise ModelLoadError(
            f"tensor {name!r}: this tensor-parallel rank's share of its {'output rows' if axis == 'n' else 'input columns'}"
            f" (elements {start}:{start + size}) does not fall on the {block}-element blocks of its layout; use a "
            "tensor_parallel_size that splits the layer on block boundaries")
    out = loaded.narrow(dim, start // block * index_bytes, size // block * index_bytes)
    if special is not None and special[0] == "g_idx":
        out = out - start // special[1]
    if gguf is not None:
        out.ggml_type = loaded.ggml_type
    return out
