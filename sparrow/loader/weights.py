"""The generic weight loader: checkpoint (name, tensor) pairs -> the model's parameters.

The model maps each checkpoint name to (parameter name, shard id) with ``resolve_weight`` (packed
projections, stacked experts); the parameter's ``weight_loader(param, tensor, shard_id, name)`` copies it.
Loading fails loudly, naming the tensor, on unused checkpoint tensors (a quantized format's scale named as
such, ``describe``), misshaped tensors, a packed (float8 / integer)
tensor for a float parameter, and parameters left unfilled; a format's own loaders check its
tensors (FP8: finite scales, no NaN bytes). A whole-tensor
load (shard id None) completes a parameter whatever its shards (e.g. transformers 5's fused 3-D
``experts.gate_up_proj`` fills the stacked experts in one go).

The parameters' own loaders (the default whole-tensor copy, stacked experts filled per expert slice) are the
weight formats': ``sparrow.quant.weight_loaders``.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import nn

from sparrow.devices import release_freed_host_memory
from sparrow.errors import ModelLoadError
from sparrow.quant.weight_loaders import default_weight_loader

log = logging.getLogger(__name__)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _packed(t: torch.Tensor) -> bool:
    """A tensor in a quantized storage dtype (float8, or integer codes) that no cast to a float dtype reads."""
    return t.dtype in _FP8_DTYPES or not (t.is_floating_point() or t.is_complex())


def expected_shards(param: nn.Parameter) -> list:
    """The shard ids that must all be loaded for ``param`` to be complete."""
    if hasattr(param, "expected_shards"):
        return list(param.expected_shards)
    n = getattr(param, "num_shards", 1)
    return [None] if n == 1 else list(range(n))


def _layer_format(model: nn.Module, pname: str, describe):
    """(module name, the checkpoint tensor suffixes its weight format takes, that format's title or None for a
    float layer) of the layer that parameter ``pname`` would belong to (or the stacked experts of a per-expert
    name, experts.N.down_proj.weight); None when no such layer (a module with a weight method) exists."""
    parts = pname.split(".")[:-1]
    while parts:
        module = ".".join(parts)
        try:
            owner = model.get_submodule(module)
        except AttributeError:
            owner = None
        if getattr(owner, "quant_kind", None) is not None:
            return (module, *_module_format(module, owner, describe))
        parts.pop()
    return None


def _module_format(module: str, owner: nn.Module, describe) -> tuple[list[str], str | None]:
    """(the checkpoint tensor suffixes the weight format of layer ``owner`` (named ``module``) takes, that
    format's title, None for a float layer)."""
    table = getattr(getattr(owner, "quant_method", None), "checkpoint_tensors", None)  # experts: per-expert suffixes
    takes = list(dict.fromkeys(t[0] for t in table) if table else getattr(owner, "_quant_param_names", None) or [])
    known = [describe(f"{module}.{t}") for t in takes] if describe is not None else []
    return takes, next((k[0] for k in known if k is not None), None)


def _float_in_quantized_layer(model: nn.Module, name: str, pname: str, tensor: torch.Tensor, describe):
    """The error for float ``weight`` tensor ``name`` (for parameter ``pname``, which the model lacks) of a layer
    whose weight format takes other tensors, some of which ``describe`` names (a quantized checkpoint that does
    not declare the layer float); None for any other unused tensor."""
    if not pname.endswith(".weight") or not tensor.is_floating_point() or _packed(tensor):
        return None
    layer = _layer_format(model, pname, describe)
    if layer is None or layer[2] is None:  # a float layer: not this case
        return None
    module, takes, title = layer
    return ModelLoadError(f"checkpoint tensor {name!r} is a float weight, but {module!r} takes {title} tensors "
                          f"{takes}: the checkpoint's quantization_config leaves it quantized (a float layer of a "
                          "quantized checkpoint is named by its ignore list, targets or modules_to_not_convert)")


def _format_tensor_without_parameter(model: nn.Module, name: str, pname: str, title: str, kind: str, describe):
    """The error for checkpoint tensor ``name``, ``kind`` of weight format ``title``, whose parameter ``pname``
    the model lacks: its layer is float in a model that loads layers of that format (the config leaves it so, or
    sparrow keeps it so), its layer is of that format but takes other tensors (e.g. zero points under
    ``symmetric: true``), or else config.json declares no such format."""
    arch = type(model).__name__
    layer = _layer_format(model, pname, describe)
    in_format = any(_module_format(m, o, describe)[1] == title  # the model loads a checkpoint of this format
                    for m, o in model.named_modules() if getattr(o, "quant_kind", None) is not None)
    if layer is not None and layer[2] is None and in_format:
        return ModelLoadError(
            f"checkpoint tensor {name!r} is {kind}, but {layer[0]!r} is a float layer of {arch}: the checkpoint's "
            "quantization_config leaves it in float (its ignore list, targets or modules_to_not_convert name it), "
            "or it is one sparrow keeps in float (embeddings, LM head, norms, routers)")
    if layer is not None and layer[2] == title:
        return ModelLoadError(
            f"checkpoint tensor {name!r} is {kind}, but {layer[0]!r} takes the {layer[2]} tensors {layer[1]}: the "
            f"checkpoint's quantization_config does not declare {kind} for it (e.g. zero points with symmetric: true)")
    return ModelLoadError(
        f"checkpoint tensor {name!r} is {kind}, but {arch} has no {title} parameter {pname!r}: config.json lacks an "
        f"{title} quantization_config, or the module is one sparrow keeps in float (embeddings, LM head, norms, "
        "routers)")


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 describe: Callable[[str], tuple[str, str] | None] | None = None) -> None:
    """Fill every parameter of ``model`` from ``tensors``. ``describe(name)``: (format title, what the tensor is)
    for a tensor name a weight format claims (``sparrow.quant.registry.describe_checkpoint_tensor``), so an unused
    one is named as such. Raises ModelLoadError naming the first unused
    tensor, misshaped tensor, or missing parameter (with its expected shape)."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    skipped = 0
    names: list[str] = []  # the checkpoint's tensor names, to spell the missing ones as it would
    on_host = any(p.device.type == "cpu" for p in params.values())
    for name, tensor in tensors:
        names.append(name)
        target = model.resolve_weight(name)
        if target is None:
            skipped += 1
            continue
        pname, shard = target
        if pname not in params:
            known = describe(name) if describe is not None else None
            if known is not None:
                raise _format_tensor_without_parameter(model, name, pname, *known, describe)
            raise _float_in_quantized_layer(model, name, pname, tensor, describe) or ModelLoadError(
                f"checkpoint tensor {name!r} is not used by {type(model).__name__} (no parameter {pname!r})"
            )
        param = params[pname]
        if _packed(tensor) and param.is_floating_point() and param.dtype != tensor.dtype:  # never cast silently
            layer = _layer_format(model, pname, describe)
            if layer is not None and layer[2] is not None and not pname.endswith(".weight"):  # a scale, as integers
                raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}, but {pname!r} of the "
                                     f"{layer[2]} layer {layer[0]!r} is {param.dtype}")
            raise ModelLoadError(
                f"checkpoint tensor {name!r} is {tensor.dtype}, but {pname!r} is {param.dtype}: a quantized weight "
                "needs its scales and the checkpoint's quantization_config in config.json (and sparrow keeps "
                "embeddings, the LM head, norms and routers in float)")
        if shard is not None and shard not in expected_shards(param):
            raise ModelLoadError(
                f"checkpoint tensor {name!r} is not used by {type(model).__name__} "
                f"({pname!r} has no shard {shard!r})")
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard, name)
        if on_host:  # what the tensor's read buffer and an on-load quantization freed goes back to the OS
            del tensor
            release_freed_host_memory("cpu")
        loaded.setdefault(pname, set()).add(shard)
    if skipped:
        log.info("skipped %d checkpoint tensors outside the text decoder", skipped)
    for pname, param in params.items():
        got = loaded.get(pname, set())
        if None in got:
            continue
        missing = [s for s in expected_shards(param) if s not in got]
        if missing and not getattr(param, "optional", False):  # optional: a format's tensor some checkpoints omit
            spelled = getattr(model, "checkpoint_name", lambda n, _: n)(pname, names)
            if missing == [None]:
                shape = getattr(param, "checkpoint_shape", tuple(param.shape))
                raise ModelLoadError(f"checkpoint lacks the tensor for {spelled!r}, expected shape "
                                     f"{_shape_text(shape)}")
            describe = getattr(model, "describe_shard", None)
            what, shape = describe(pname, missing[0], names) if describe else (f"{pname!r} shard {missing[0]!r}", None)
            shape = getattr(param, "checkpoint_shape", shape)  # a format's tensor stored in another shape
            more = f" (and {len(missing) - 1} more shards of {spelled!r})" if len(missing) > 1 else ""
            raise ModelLoadError(f"checkpoint lacks the tensor {what}, expected shape "
                                 f"{_shape_text(shape)}{more}")


def _shape_text(shape) -> str:
    """A shape for a message: "(N, K)", "() (a scalar)", or "?" when unknown (None)."""
    if shape is None:
        return "?"
    return str(tuple(shape)) if len(shape) else "() (a scalar)"
