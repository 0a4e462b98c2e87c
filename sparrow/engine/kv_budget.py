"""Sizing the paged KV pool from the memory settings (vLLM's ``gpu_memory_utilization``, ``kv_cache_memory``
and the ``num_kv_blocks`` override), after the weights are loaded and before any CUDA graph is captured.

``plan_kv_pool`` is a pure function of byte counts; the model runner measures them and calls it. Units: bytes,
tokens and blocks of ``block_size`` tokens. The pool allocates one block more than it hands out (the pad block
CUDA-graph padding rows write to); every figure here counts it.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparrow.config.values import parse_size  # noqa: F401  (re-exported: the CLI reads --kv-cache-memory with it)
from sparrow.errors import InsufficientMemoryError, InvalidRequestError

GIB = 1 << 30

GRAPH_FIXED_BYTES = 8 << 20
"""Memory a captured CUDA graph holds besides its logits (static activations of its batch, kernel workspaces):
an estimate per graph, for the reserve taken off the KV budget."""

def graph_reserve_bytes(buckets: list[int], query_lens: tuple[int, ...], vocab_size: int) -> int:
    """Estimated device memory of the CUDA graphs of (bucket, q) for every bucket and q: each keeps its fp32
    logits [bucket q, vocab] alive, plus GRAPH_FIXED_BYTES. 0 when there are no buckets (no graphs)."""
    n = len(buckets) * len(query_lens)
    return sum(b * q for b in buckets for q in query_lens) * vocab_size * 4 + n * GRAPH_FIXED_BYTES


@dataclass(frozen=True)
class KVPool:
    """The KV pool's size: ``num_blocks`` blocks handed out (+ 1 pad block allocated) of ``block_size`` tokens,
    ``bytes_per_token`` over all layers (and a draft model's pool of as many blocks), and what sized it."""

    num_blocks: int
    """Blocks the block manager hands out."""
    block_size: int
    """Tokens per block."""
    bytes_per_token: int
    """K and V bytes of one token over all layers (a draft model's included)."""
    budget: str
    """What set the size, for the start-up line: 'num_kv_blocks', 'kv_cache_memory=...', the utilization."""

    @property
    def num_tokens(self) -> int:
        """Tokens the handed-out blocks hold."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes allocated, pad block included."""
        return (self.num_blocks + 1) * self.block_size * self.bytes_per_token

    def describe(self) -> str:
        """The start-up line: 'KV pool: N blocks x B tokens = T tokens, X GiB (budget: ...)'."""
        return (f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
                f"{_gib(self.nbytes)} (budget: {self.budget})")


def _gib(n: float) -> str:
    """Bytes as GiB, two decimals (MiB or KiB below 1 GiB or 1 MiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def plan_kv_pool(*, bytes_per_token: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.85, device_total: int | None = None,
                 device_free: int | None = None, cpu_budget: int | None = None, weights_bytes: int = 0,
                 graph_reserve: int = 0) -> KVPool:
    """The KV pool for these settings. A device (``device_total`` and ``device_free``, bytes, measured after the
    weights loaded) or, without one, ``cpu_budget`` (bytes). ``weights_bytes`` is for messages only; the free
    memory already excludes the weights. ``graph_reserve``: bytes the CUDA graphs will take (0 without graphs).

    - ``num_kv_blocks`` given: exactly that many blocks (on a device they must fit the free memory).
    - ``kv_cache_memory`` given: as many blocks as that many bytes hold (vLLM: it ignores the utilization;
      on CPU it replaces ``cpu_budget``); on a device it must fit the free memory.
    - otherwise: the budget is ``gpu_memory_utilization`` x total - what is in use - the graph reserve (device),
      or ``cpu_budget``; the pool takes what max_num_seqs sequences of max_model_len need, at most the budget.

    Raises InvalidRequestError for num_kv_blocks with kv_cache_memory; InsufficientMemoryError when the pool
    cannot hold one sequence of max_model_len tokens or does not fit the free memory (the message names the
    weights, free and total memory and the setting to change)."""
    if num_kv_blocks is not None and kv_cache_memory is not None:
        raise InvalidRequestError(f"num_kv_blocks={num_kv_blocks} and kv_cache_memory={kv_cache_memory} both size "
                                  "the KV pool: give one")
    per_block = bytes_per_token * block_size
    need_one = -(-max_model_len // block_size)
    on_device = device_total is not None
    if on_device and device_free is None:
        raise ValueError("plan_kv_pool: device_total needs device_free")
    memory = (f"the weights take {_gib(weights_bytes)}; the device has {_gib(device_free)} free of "
              f"{_gib(device_total)} total" if on_device else "")
    if num_kv_blocks is not None:
        pool = KVPool(num_kv_blocks, block_size, bytes_per_token, "num_kv_blocks")
        if num_kv_blocks < need_one:
            raise InsufficientMemoryError(f"num_kv_blocks={num_kv_blocks} of {block_size} tokens cannot hold one "
                                          f"sequence of max_model_len={max_model_len} tokens")
        if on_device and pool.nbytes + graph_reserve > device_free:
            raise InsufficientMemoryError(
                f"num_kv_blocks={num_kv_blocks} needs {_gib(pool.nbytes)} of KV (+ {_gib(graph_reserve)} for CUDA "
                f"graphs), more than is free: {memory}. Lower num_kv_blocks (--num-kv-blocks)")
        return pool
    if kv_cache_memory is not None:
        budget, what, flag = kv_cache_memory, f"kv_cache_memory={_gib(kv_cache_memory)}", "kv_cache_memory"
        if on_device and kv_cache_memory + graph_reserve > device_free:
            raise InsufficientMemoryError(
                f"kv_cache_memory={_gib(kv_cache_memory)} (+ {_gib(graph_reserve)} for CUDA graphs) is more than "
                f"is free: {memory}. Lower kv_cache_memory (--kv-cache-memory)")
    elif on_device:
        used = device_total - device_free
        budget = gpu_memory_utilization * device_total - used - graph_reserve
        what = (f"gpu_memory_utilization={gpu_memory_utilization} of {_gib(device_total)} - {_gib(used)} in use - "
                f"{_gib(graph_reserve)} CUDA graphs = {_gib(max(budget, 0))}")
        flag = "gpu_memory_utilization"
    else:
        budget, what, flag = cpu_budget, f"CPU {_gib(cpu_budget)}", "kv_cache_memory"
    fits = int(max(budget, 0) // per_block) - 1  # the pad block comes out of the budget too
    if fits < need_one:
        change = {"kv_cache_memory": "raise kv_cache_memory (--kv-cache-memory)",
                  "gpu_memory_utilization": "raise gpu_memory_utilization (--gpu-memory-utilization) or set "
                                            "kv_cache_memory (--kv-cache-memory)"}[flag]
        cause = f" ({memory})" if on_device else ""
        raise InsufficientMemoryError(
            f"the KV pool cannot hold one sequence of max_model_len={max_model_len} tokens: it needs "
            f"{_gib((need_one + 1) * per_block)} ({bytes_per_token} bytes per token), the budget is {what}{cause}, "
            f"which holds {max(fits, 0) * block_size} tokens. Lower max_model_len (--max-model-len) or {change}")
    want = max_num_seqs * need_one
    if kv_cache_memory is None and want < fits:
        return KVPool(want, block_size, bytes_per_token, f"{what}, capped at max_num_seqs={max_num_seqs} x "
                                                         f"max_model_len={max_model_len}")
    return KVPool(fits, block_size, bytes_per_token, what)


def agree_over_ranks(pool: KVPool, world_size: int) -> KVPool:
    """``pool`` with the fewest blocks any rank of the tensor-parallel group of ``world_size`` ranks
    (``sparrow.distributed.get_tp()``) sized, so every rank's block manager view is the same (a collective: every
    rank calls it once, at start-up); ``pool`` itself for one rank."""
    import dataclasses

    import torch

    from sparrow.distributed import get_tp

    if world_size == 1:
        return pool
    comm = get_tp()
    if comm.world_size != world_size:
        raise RuntimeError(f"the KV pool of {world_size} ranks needs their group; this process is in one of "
                           f"{comm.world_size}")
    counts = comm.all_gather(torch.tensor([pool.num_blocks], dtype=torch.int64, device=comm.device), dim=0)
    fewest = int(counts.min())
    if fewest == pool.num_blocks:
        return pool
    return dataclasses.replace(pool, num_blocks=fewest, budget=f"{pool.budget}; the fewest of "
                                                               f"{comm.world_size} ranks")
