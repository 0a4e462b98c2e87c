"""Compute kernels, grouped by kind: ``gemm`` (the linear formats: FP8, int4, NVFP4), ``moe`` (router and
experts), ``attention`` (paged decode / prefill, the KV write), ``norm_rope``, ``activation``, ``lora``, and
``common`` (the Triton helpers and split-K workspace they share). Each Triton kernel sits beside a torch twin with
the same signature; the twin is the CPU path and the test oracle.

One choice decides Triton or twin: ``use_triton(x)``, Triton for CUDA tensors, the torch twin otherwise. A kernel
module declares its public op as ``dispatch(name, triton_fn, ref_fn, doc)``; ops with more than two paths and
the layers' fused paths call ``use_triton`` themselves. ``set_backend("torch")`` makes everything use the twins
even on the GPU (the reference path that the Triton path is tested against), ``set_backend("triton")`` forces
the kernels even on CPU (under TRITON_INTERPRET=1, for tests), and ``set_backend(None)`` restores the default.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from sparrow import switches

_BACKEND: str | None = None
_CAPABILITIES: dict[int, tuple[int, int]] = {}


def set_backend(name: str | None) -> None:
    """'torch', 'triton' or None (by device). Raises ValueError for another name."""
    global _BACKEND
    if name not in (None, "torch", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; expected 'torch', 'triton' or None")
    _BACKEND = name


def get_backend() -> str | None:
    return _BACKEND


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[None]:
    """``set_backend`` inside a with-block."""
    old = _BACKEND
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer should run the Triton kernel on tensor ``x``."""
    if _BACKEND is not None:
        return _BACKEND == "triton"
    return x.is_cuda


def dispatch(name: str, triton_fn: Callable, ref_fn: Callable, doc: str,
             fits: Callable[..., bool] | None = None) -> Callable:
    """The public op ``name`` of a kernel and its torch twin: ``triton_fn(*args)`` where ``use_triton`` of the first
    argument (the tensor that says where the op runs) and, if given, ``fits(*args)`` (a bound the kernel has, e.g.
    a row count), else ``ref_fn(*args)``; same keyword arguments. ``inspect.signature`` shows ref_fn's."""
    if fits is None:
        def op(x, *args, **kwargs):
            return (triton_fn if use_triton(x) else ref_fn)(x, *args, **kwargs)
    else:
        def op(x, *args, **kwargs):
            fn = triton_fn if use_triton(x) and fits(x, *args, **kwargs) else ref_fn
            return fn(x, *args, **kwargs)
    op.__name__ = op.__qualname__ = name
    op.__module__ = triton_fn.__module__
    op.__doc__ = doc
    op.__wrapped__ = ref_fn  # the signature
    return op


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``switches.TRITON_INTERPRET``), where launchers switch
    on their interpreter workarounds (``_fp8_jit``) and PDL stays off."""
    return switches.TRITON_INTERPRET


def use_pdl(x: torch.Tensor) -> bool:
    """Whether a kernel on x's device launches with programmatic dependent launch (``launch_pdl=True`` and its
    ``pdl_enter`` prologue, sparrow/kernels/common/_pdl_jit.py): the PDL switch is on, x is a CUDA tensor of a device of
    compute capability >= 9.0 (Hopper), and Triton is not the interpreter. ``switches.PDL`` (``SPARROW_PDL``)."""
    if not (switches.PDL and x.is_cuda) or interpreting():
        return False
    return device_capability(x.device)[0] >= 9


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability (major, minor) of ``device`` (a CUDA device), asked once per device: the
    launchers consult it on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return cap


def pdl_kwargs(x: torch.Tensor) -> dict:
    """Launch keywords of a kernel with a ``pdl_enter`` prologue: ``USE_PDL`` and ``launch_pdl`` by ``use_pdl(x)``."""
    on = use_pdl(x)
    return {"USE_PDL": on, "launch_pdl": on}


class ForcedConfig:
    """A tile config that overrides a kernel's heuristic inside a ``with`` block (tests, tuning):
    ``with forced_config(cfg): ...``; the launcher reads ``.value`` (None outside the block)."""

    def __init__(self) -> None:
        self.value = None

    @contextlib.contextmanager
    def __call__(self, config):
        previous, self.value = self.value, config
        try:
            yield config
        finally:
            self.value = previous
