"""This process's place in the parallel group: the tensor-parallel Communicator every layer reads (rank 0 of
1 until ``init_distributed`` runs), and the arithmetic of splitting a dimension over the ranks.

Layers read ``tp_rank()`` / ``tp_size()`` when they are built (the model is built after the process group
exists), so a model built in a plain process is the single-rank model.
"""
from __future__ import annotations

import datetime

import torch

from sparrow.distributed.communicator import Communicator
from sparrow.errors import ModelLoadError

_TP = Communicator()
_EXPERT_PARALLEL = False
_EXPERT_DISPATCH = "all_reduce"


def get_tp() -> Communicator:
    """The tensor-parallel group's Communicator (one rank in a plain process)."""
    return _TP


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.world_size


def expert_parallel() -> tuple[bool, str]:
    """(experts split across the ranks, dispatch mode 'all_reduce' | 'all_to_all')."""
    return _EXPERT_PARALLEL, _EXPERT_DISPATCH


def set_expert_parallel(enabled: bool, dispatch: str = "all_reduce") -> None:
    global _EXPERT_PARALLEL, _EXPERT_DISPATCH
    _EXPERT_PARALLEL, _EXPERT_DISPATCH = bool(enabled), dispatch


def init_distributed(rank: int, world_size: int, init_method: str, device: str,
                     timeout_s: float = 600.0) -> Communicator:
    """Join the process group of ``world_size`` ranks at ``init_method`` (a ``tcp://host:port`` or
    ``file://`` URL): NCCL when ``device`` is CUDA (this rank's GPU is cuda:rank), gloo on CPU; returns the
    group's Communicator, also ``get_tp()`` from now on. ``timeout_s``: how long a collective may wait for a
    missing rank before it raises."""
    global _TP
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    if world_size == 1 and not cuda:
        _TP = Communicator(0, 1, None, device)
        return _TP
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": torch.device("cuda", rank)} if cuda else {}))
    _TP = Communicator(rank, world_size, dist.group.WORLD, f"cuda:{rank}" if cuda else "cpu")
    return _TP


def destroy_distributed() -> None:
    """Leave the process group (if any); ``get_tp()`` is one rank again."""
    global _TP
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TP = Communicator()
    set_expert_parallel(False)


def divide(total: int, world_size: int, what: str) -> int:
    """total // world_size; raises ModelLoadError naming ``what`` when the ranks cannot split it evenly."""
    if total % world_size:
        raise ModelLoadError(f"{what} ({total}) is not divisible by tensor_parallel_size={world_size}")
    return total // world_size


def shard_range(total: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """(start, size) of rank's even share of ``total`` (``divide``'s errors)."""
    size = divide(total, world_size, what)
    return rank * size, size


def free_port() -> int:
    """A TCP port free on this host now (the ranks' rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_init_method() -> str:
    """A tcp:// rendezvous on a free port of this host."""
    return f"tcp://127.0.0.1:{free_port()}"
