"""Compute kernels. Each Triton kernel sits beside a torch twin with the same signature; the twin is
the CPU path and the test oracle (style.md 7-8).

The layers pick a kernel with ``use_triton(x)``: Triton for CUDA tensors, the torch twin otherwise.
``set_backend("torch")`` makes every layer use the twins even on the GPU (the reference path that the
Triton path is tested against), ``set_backend("triton")`` forces the kernels even on CPU (under
TRITON_INTERPRET=1, for tests), and ``set_backend(None)`` restores the default.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

_BACKEND: str | None = None

PDL = os.environ.get("SPARROW_PDL", "1") != "0"
"""Launch the decode-path kernels with programmatic dependent launch where the GPU has it (``use_pdl``);
``SPARROW_PDL=0`` in the environment (or ``PDL = False`` before the kernels first run) turns it off. H200,
gemma4-26b-a4b bf16 decode with CUDA graphs: 309.4 / 1,032.8 tok/s at batch 1 / 8, against 294.7 / 961.4
without (benchmarks/README.md)."""
_CAPABILITIES: dict[int, tuple[int, int]] = {}

PREFETCH_BYTES = int(os.environ.get("SPARROW_PREFETCH", "0"))
"""When > 0, weight kernels launched with PDL (the GEMV, the MoE down GEMV) first hint up to this many bytes of
each weight row of their tile into L2, before they wait for the previous kernel (``_pdl_jit.prefetch_tile_l2``;
``SPARROW_PREFETCH=4096`` in the environment). Off by default: on the H200, gemma4-26b-a4b bf16 at batch 1
ran at 290.2 tok/s with the MoE down prefetch on, 287.7 without it on another machine, and 242.9 with the
dense linears on the prefetching GEMV instead of cuBLAS (benchmarks/README.md, sixth session)."""


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


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``), where launchers switch on
    their interpreter workarounds (``_fp8_jit``) and PDL stays off."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_pdl(x: torch.Tensor) -> bool:
    """Whether a kernel on x's device launches with programmatic dependent launch (``launch_pdl=True`` and its
    ``pdl_enter`` prologue, sparrow/kernels/_pdl_jit.py): ``PDL`` is on, x is a CUDA tensor of a device of
    compute capability >= 9.0 (Hopper), and Triton is not the interpreter."""
    if not (PDL and x.is_cuda) or interpreting():
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


def prefetch_bytes(x: torch.Tensor, w: torch.Tensor) -> int:
    """The PREFETCH constexpr of a weight kernel on activations x and weight w [..., N, K] (unit stride on K):
    PREFETCH_BYTES when x's kernels use PDL and w's base, row pitch and row length are multiples of 16 bytes
    (the bulk prefetch's alignment), else 0."""
    size = w.element_size()
    if PREFETCH_BYTES <= 0 or not use_pdl(x) or w.stride(-1) != 1:
        return 0
    if w.data_ptr() % 16 or (w.stride(-2) * size) % 16 or (w.shape[-1] * size) % 16 or w.shape[-1] * size < 16:
        return 0
    return PREFETCH_BYTES


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
