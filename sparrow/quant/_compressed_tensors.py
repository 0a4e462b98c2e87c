"""What the compressed-tensors formats (int4 ``pack-quantized``, NVFP4 ``nvfp4-pack-quantized``) share beyond their
weights: the parts of a checkpoint's ``quantization_config`` that change how its tensors are read or run."""
from __future__ import annotations

from sparrow.errors import ModelLoadError

_OFFLINE = ("weight_input", "weight_output")
"""transform_config locations fused into the weights at export (compressed-tensors' TransformLocation.is_online)."""


def check_extras(qc: dict, what: str) -> None:
    """Raise ModelLoadError naming the field when ``qc`` has a ``sparsity_config`` that compresses the weights (any
    format but "dense") or a ``transform_config`` that rotates activations, KV or queries at run time (QuIP /
    SpinQuant online Hadamards): sparrow would read or run such a checkpoint wrong. ``what``: the format's title."""
    sparsity = qc.get("sparsity_config") or {}
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
        fmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
        raise ModelLoadError(f"compressed-tensors {what} checkpoint: sparsity_config format {fmt!r} (sparse-compressed "
                             "weights) is not supported; sparrow loads dense weights")
    transforms = qc.get("transform_config") or {}
    groups = transforms.get("config_groups") if isinstance(transforms, dict) else None
    if transforms and not isinstance(groups, dict):
        raise ModelLoadError(f"compressed-tensors {what} checkpoint: transform_config must be an object with "
                             f"config_groups, got {transforms!r}")
    for name, scheme in (groups or {}).items():
        apply = scheme.get("apply") if isinstance(scheme, dict) else None
        if not isinstance(apply, list) or not all(isinstance(a, dict) for a in apply):
            raise ModelLoadError(f"compressed-tensors {what} checkpoint: transform_config group {name!r} must be an "
                                 f"object with an apply list of objects, got {scheme!r}")
        online = [a.get("location") for a in apply if a.get("location") not in _OFFLINE]
        if online:
            raise ModelLoadError(f"compressed-tensors {what} checkpoint: transform_config group {name!r} applies "
                                 f"{online[0]!r} transforms online (at run time), which sparrow does not run; only "
                                 f"rotations fused into the weights ({', '.join(_OFFLINE)}) load")
