"""Device and compute-dtype names: what ``device='auto'`` and ``dtype='auto'`` resolve to, and which names exist."""
from __future__ import annotations

import torch

from sparrow.errors import InvalidRequestError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""EngineConfig.dtype name -> torch dtype."""


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cpu' and 'cuda[:N]' as given. Raises
    InvalidRequestError for 'cuda' without a GPU and for any other name."""
    if not isinstance(device, str):
        raise InvalidRequestError(f"device={device!r} must be a string ('auto', 'cpu' or 'cuda')")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' was asked for but no CUDA GPU is visible")
    if device != "cpu" and not device.startswith("cuda"):
        raise InvalidRequestError(f"unknown device {device!r} (use 'auto', 'cpu' or 'cuda')")
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16, read from /proc/cpuinfo), so that
    bf16 weights halve the bytes of a matmul without a slow emulation."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bfloat16 on CUDA and on CPUs with native bf16 (decode reads half the bytes of fp32),
    float32 on other CPUs; a name of TORCH_DTYPES as given. Raises InvalidRequestError for another name."""
    if dtype == "auto":
        if device.startswith("cuda") or cpu_has_native_bf16():
            return "bfloat16"
        return "float32"
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r} (use 'auto', 'float32', 'bfloat16' or 'float16')")
    return dtype
