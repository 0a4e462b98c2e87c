"""Device and compute-dtype names: what ``device='auto'`` and ``dtype='auto'`` resolve to, and which names exist;
torch's CPU thread count, one rule for every entry point (``default_cpu_threads``)."""
from __future__ import annotations

import contextlib
import os

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


def default_cpu_threads() -> int:
    """torch's CPU threads when none is asked for, the same for ``LLM()``, ``generate``, ``chat``, ``serve`` and
    ``bench``: 1 on a machine with at most 2 cores this process may use (one busy core then stalls every step of
    a 2-thread decode: seconds instead of tens of ms), else half of them (room for other load; decode is
    memory-bound). OMP_NUM_THREADS is not read: ``--threads`` / ``set_cpu_threads`` choose another count."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return 1 if cores <= 2 else cores // 2


_THREADS_CHOSEN = False  # set_cpu_threads ran: LLM() keeps the count


def set_cpu_threads(n: int | None = None) -> int:
    """Set torch's CPU threads to ``n`` (None: ``default_cpu_threads()``) for this process; later ``LLM()``s keep
    it. Returns the count set."""
    global _THREADS_CHOSEN
    n = n or default_cpu_threads()
    torch.set_num_threads(n)
    _THREADS_CHOSEN = True
    return n


def ensure_cpu_threads() -> None:
    """``LLM()``'s call: the default thread count, unless this process chose one (``set_cpu_threads``, the CLI's
    ``--threads``, or an earlier ``LLM()``: a ``torch.set_num_threads`` after it is kept)."""
    if not _THREADS_CHOSEN:
        set_cpu_threads(None)


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """``set_cpu_threads(n)`` for the block, then torch's count and the chosen state as they were (the CLI's
    ``main`` run in-process, e.g. by tests)."""
    global _THREADS_CHOSEN
    before, chosen = torch.get_num_threads(), _THREADS_CHOSEN
    try:
        yield set_cpu_threads(n)
    finally:
        torch.set_num_threads(before)
        _THREADS_CHOSEN = chosen


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


def release_freed_host_memory(device: torch.device | str) -> None:
    """Return the host pages that freed tensors left in the C heap to the OS (glibc ``malloc_trim(0)``), so the
    process's RSS follows the live tensors. glibc raises its mmap threshold after large frees, so the float
    copies and fp32 temporaries that on-load quantization frees stay resident otherwise (a random Qwen3-MoE
    loaded with ``quantization="fp8"`` peaked 50 MB higher without it). A no-op for CUDA tensors and where the
    C library has no ``malloc_trim`` (macOS, musl)."""
    if torch.device(device).type != "cpu":
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    global _TRIM
    if _TRIM is False:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = None
    return _TRIM


_TRIM = False  # resolved on first use: the C library's malloc_trim, or None


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak for ``peak_memory``: torch's allocator peak on CUDA; on the CPU the process's high-water
    RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` on Linux >= 4.0; elsewhere the lifetime peak stays)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory(device: torch.device | str) -> int:
    """Bytes at the peak since ``reset_peak_memory``: ``torch.cuda.max_memory_allocated`` on CUDA, the process's
    peak RSS on the CPU (``VmHWM``; ``ru_maxrss`` where /proc is absent)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux
