"""Run a function on several CPU ranks (gloo), each in its own spawned process: ``run_ranks(fn, world, *args)``
calls ``fn(rank, world, *args)`` on every rank after ``init_distributed``; a rank's exception fails the call
(torch.multiprocessing's ProcessRaisedException names the rank and carries its traceback)."""
from __future__ import annotations

import torch.multiprocessing as mp


def _entry(rank, fn, world, init_method, args):
    import torch

    from sparrow.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, init_method, "cpu", timeout_s=120)
    try:
        fn(rank, world, *args)
    finally:
        destroy_distributed()


def run_ranks(fn, world: int, *args) -> None:
    from sparrow.distributed.state import local_init_method

    mp.spawn(_entry, args=(fn, world, local_init_method(), args), nprocs=world, join=True)
