"""Workspace and split choice of split-K launches (the in-kernel reduce: ``_split_k_jit``).

    plan(device, tiles, k_steps, requested, tile_floats, dummy) -> (SPLIT_K, ws, locks)   what a launcher passes
    choose_split(tiles, k_steps, requested) -> SPLIT_K   programs per output tile
    workspace(device, floats, tiles) -> (ws fp32 [WORKSPACE_FLOATS], locks int32 [MAX_TILES]) or None

Kernels on one stream run one after another, so they can share one fixed-size fp32 workspace and one
int32 counter array; kernels on two streams that may run at once (Gemma 4's dense branch on its side stream)
must not. So every stream shares set 0 of its device, except streams registered with
``register_concurrent_stream``, which get sets 1, 2, ... Fixed sizes keep the addresses stable for CUDA
graphs. Nothing may be allocated and zeroed while a stream is being captured (the memset would only run at
replay), so the first call outside a capture allocates all ``SETS`` sets of the device; a call that finds
no set for its stream (all taken, or none allocated yet during a capture) gets None, and the launcher runs
without split-K.
"""
from __future__ import annotations

import torch

WORKSPACE_FLOATS = 1 << 21  # 8 MiB of fp32 partials per stream
MAX_TILES = 4096  # output tiles of one split-K launch (more tiles fill the GPU without splitting)
MAX_SPLIT = 16
SETS = 4  # buffer sets per device: all ordinary streams, and up to 3 registered concurrent streams (8 MB each)
FILL_PROGRAMS = 352
"""``choose_split`` auto target: programs (tiles x splits), about 2.7 per SM of an H100 / H200. From the H200
GEMV sweep (kernels_micro.py): N = 2816 in 32-wide tiles is fastest at split 4 (352 programs), N = 4224 at
split 2-4, N = 8192 at split 1-2."""

_SETS: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # device -> its buffer sets
_CONCURRENT: dict[tuple, int] = {}  # (device, registered stream handle) -> its set index (1, 2, ...)


def register_concurrent_stream(stream: "torch.cuda.Stream") -> None:
    """Give ``stream`` its own buffer set (the next of its device): its split-K launches may overlap those
    of other streams. Register before the stream's first launch."""
    dev = _device_key(stream.device)
    if (dev, stream.cuda_stream) not in _CONCURRENT:
        _CONCURRENT[dev, stream.cuda_stream] = 1 + sum(d == dev for d, _ in _CONCURRENT)


def _device_key(device: torch.device) -> tuple:
    if device.type == "cuda" and device.index is None:
        return device.type, torch.cuda.current_device()
    return device.type, device.index


def choose_split(tiles: int, k_steps: int, requested: int) -> int:
    """Splits per tile: ``requested`` (>= 1), or for 0 the fewest that give ``FILL_PROGRAMS`` programs, capped
    at ``MAX_SPLIT``; never more than the K steps (each split gets at least one) nor 1 when tiles > MAX_TILES."""
    if requested < 0:
        raise ValueError(f"split_k must be >= 0 (0: automatic), got {requested}")
    split = requested if requested else min(MAX_SPLIT, -(-FILL_PROGRAMS // max(tiles, 1)))
    if tiles > MAX_TILES:
        return 1
    return max(1, min(split, k_steps))


def plan(device: torch.device, tiles: int, k_steps: int, requested: int, tile_floats: int,
         dummy: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(SPLIT_K, workspace, counters) for a launch of ``tiles`` output tiles of ``tile_floats`` fp32 partial
    values each over ``k_steps`` K steps: ``choose_split``'s split when this stream's workspace holds it,
    else 1 with ``dummy`` for both buffers (the kernel does not touch them)."""
    split = choose_split(tiles, k_steps, requested)
    buffers = workspace(device, tiles * split * tile_floats, tiles) if split > 1 else None
    if buffers is None:
        return 1, dummy, dummy
    return split, buffers[0], buffers[1]


def workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This stream's (workspace, counters) if ``floats`` partial values and ``tiles`` counters fit, else None."""
    if floats > WORKSPACE_FLOATS or tiles > MAX_TILES:
        return None
    dev = _device_key(device)
    if device.type == "cuda":
        index = _CONCURRENT.get((dev, torch.cuda.current_stream(device).cuda_stream), 0)
        capturing = torch.cuda.is_current_stream_capturing()
    else:  # the interpreter (CPU tensors) runs programs one at a time
        index, capturing = 0, False
    sets = _SETS.get(dev)
    if sets is None:
        if capturing:
            return None
        sets = _SETS[dev] = [(torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                              torch.zeros(MAX_TILES, dtype=torch.int32, device=device)) for _ in range(SETS)]
    return sets[index] if index < len(sets) else None
