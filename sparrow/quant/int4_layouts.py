"""int4 checkpoint layouts (compressed-tensors pack-quantized, GPTQ, AWQ; see ``sparrow.quant.int4``) -> the kernels'
layout (``sparrow.kernels.gemm.int4``), one tensor at a time, for the dense linears and the routed experts.

Shapes: N = rows = out features of the tensor, K = in features, G = ceil(K / group).
"""
from __future__ import annotations

import torch

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.int4 import GROUP_SIZES, PACK, SYMMETRIC_ZERO, num_groups, pack_int4_ref, unpack_int4_ref

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ GEMM packing: nibble i of a word holds column AWQ_ORDER[i] of its 8."""
_AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(PACK))


# ---- checkpoint tensor -> kernel layout (rows = this tensor's output rows, k = in features) ------------------

def shape_error(name: str, t: torch.Tensor, want) -> ModelLoadError:
    return ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(want)}")


def _need(name: str, t: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise shape_error(name, t, shape)
    if dtype is not None and t.dtype != dtype:
        raise ModelLoadError(f"tensor {name!r} is {t.dtype}, the int4 layout needs {dtype}")
    if dtype is None and not t.is_floating_point():
        raise ModelLoadError(f"tensor {name!r} is {t.dtype}, an int4 scale must be a float tensor")
    if dtype is None and not bool(torch.isfinite(t).all()):
        raise ModelLoadError(f"checkpoint tensor {name!r} (int4 scales) holds non-finite values: the checkpoint is "
                             "corrupt")
    return t


def _unpack_columns(t: torch.Tensor, cols: int, order=None) -> torch.Tensor:
    """int32 [A, ceil(cols / 8)] packing 8 columns a word -> uint8 [A, cols] (``order``: AWQ's interleave)."""
    u = unpack_int4_ref(t.contiguous())
    if order is not None:
        u = u.reshape(u.shape[0], -1, PACK)[..., list(order)].reshape(u.shape[0], -1)
    return u[:, :cols]


def convert(layout: str, kind: str, t: torch.Tensor, rows: int, k: int, group: int, name: str,
            gptq_v1: bool = True) -> torch.Tensor:
    """One checkpoint tensor of ``layout`` holding ``rows`` output rows -> the kernel layout's tensor with the rows
    on dim 0 (``kind``: "packed", "scale", "zero", "shape", "g_idx"; the last two are only checked: returned
    [1, 2] / [1, K]). Raises ModelLoadError naming ``name`` on a shape, dtype or g_idx it cannot take."""
    g = num_groups(k, group)
    if kind == "shape":
        if t.numel() != 2 or [int(v) for v in t.reshape(-1)] != [rows, k]:
            raise ModelLoadError(f"tensor {name!r} says weight shape {t.tolist()}, the model needs {[rows, k]}")
        return t.reshape(1, 2).to(torch.int64)
    if kind == "g_idx":
        if t.numel() != k:
            raise ModelLoadError(f"tensor {name!r} has {t.numel()} entries; a GPTQ g_idx has one per input column "
                                 f"({k})")
        got = t.reshape(-1).to(torch.int64).cpu()
        want = torch.arange(k, dtype=torch.int64) // group
        if not torch.equal(got, want):
            for other in GROUP_SIZES:
                if other != group and torch.equal(got, torch.arange(k, dtype=torch.int64) // other):
                    raise ModelLoadError(f"tensor {name!r} is a g_idx of group size {other}, but the checkpoint's "
                                         f"config says group_size {group}")
            raise ModelLoadError(f"tensor {name!r}: GPTQ activation order (desc_act / a g_idx other than k // "
                                 f"{group}) is not supported; quantize with desc_act=false")
        return t.reshape(1, k).to(torch.int32)
    if layout == "compressed-tensors":
        if kind == "packed":
            return _need(name, t, (rows, k // PACK), torch.int32)
        if kind == "scale":
            return _need(name, t, (rows, g))
        if kind == "zero":  # packed along N: word [n // 8, g], signed zero point + 8
            _need(name, t, (-(-rows // PACK), g), torch.int32)
            return _unpack_columns(t.t(), rows).t().contiguous()
    elif layout in ("gptq", "awq"):
        order = _AWQ_INVERSE if layout == "awq" else None
        if kind == "packed":
            if layout == "gptq":  # [K / 8, N], 8 rows of K per word: the transpose of the kernel layout
                return _need(name, t, (k // PACK, rows), torch.int32).t().contiguous()
            _need(name, t, (k, -(-rows // PACK)), torch.int32)
            return pack_int4_ref(_unpack_columns(t, rows, order).t())
        if kind == "scale":
            return _need(name, t, (g, rows)).t().contiguous()
        if kind == "zero":
            _need(name, t, (g, -(-rows // PACK)), torch.int32)
            z = _unpack_columns(t, rows, order).t().contiguous()
            return z + 1 if layout == "gptq" and gptq_v1 else z  # v1 stores zero - 1 (0 reads back as 16)
    raise ValueError(f"no {kind!r} tensor in the {layout} int4 layout")


# the checkpoint tensors of each layout: (checkpoint suffix, kind)
CHECKPOINT_TENSORS: dict[str, tuple[tuple[str, str], ...]] = {
    "compressed-tensors": (("weight_packed", "packed"), ("weight_scale", "scale"), ("weight_zero_point", "zero"),
                           ("weight_shape", "shape")),
    "gptq": (("qweight", "packed"), ("scales", "scale"), ("qzeros", "zero"), ("g_idx", "g_idx")),
    "awq": (("qweight", "packed"), ("scales", "scale"), ("qzeros", "zero")),
}


def shard_layout(layout: str, kind: str, group: int) -> dict:
    """Where a checkpoint tensor of ``kind`` in ``layout`` holds the output rows N and input columns K, as
    ``sparrow.quant.weight_loaders.set_shard_layout`` takes them (a tensor-parallel share is cut from it)."""
    if kind == "shape":
        return dict(n=(0, 1), k=(0, 1), special=("shape",))
    if kind == "g_idx":
        return dict(n=None, k=(0, 1), special=("g_idx", group))
    if layout == "compressed-tensors":
        return {"packed": dict(n=(0, 1), k=(1, PACK)), "scale": dict(n=(0, 1), k=(1, group)),
                "zero": dict(n=(0, PACK), k=(1, group))}[kind]
    packed = dict(n=(1, 1), k=(0, PACK)) if layout == "gptq" else dict(n=(1, PACK), k=(0, 1))
    return {"packed": packed, "scale": dict(n=(1, 1), k=(0, group)), "zero": dict(n=(1, PACK), k=(0, group))}[kind]


def layout_tensors(config) -> tuple[tuple[str, str], ...]:
    """The (suffix, kind) pairs a layer of ``config``'s checkpoint holds (no zero points when symmetric for
    compressed-tensors, which drops them)."""
    table = CHECKPOINT_TENSORS[config.layout]
    if config.layout == "compressed-tensors" and config.symmetric:
        table = tuple(t for t in table if t[1] != "zero")
    return table


def finish_scale(scale: torch.Tensor, dtypes: set) -> torch.Tensor:
    """The loaded scales (held in fp32) back in the checkpoint's scale dtype when it had one."""
    return scale.to(next(iter(dtypes))) if len(dtypes) == 1 else scale


def finish_zero(zero: torch.Tensor | None) -> torch.Tensor | None:
    """None where every zero is 8 (symmetric GPTQ writes them all): the kernels then skip the reads."""
    return None if zero is None or bool((zero == SYMMETRIC_ZERO).all()) else zero
