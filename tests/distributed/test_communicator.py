"""The Communicator on two gloo ranks against the single-process arithmetic: sums, gathers, all-to-all row
exchange, broadcasts of tensors and objects; with one rank every call returns its input."""
from __future__ import annotations

import torch

from sparrow.distributed import Communicator
from tests.distributed._ranks import run_ranks


def _ranks_collectives(rank, world):
    from sparrow.distributed import get_tp

    comm = get_tp()
    assert (comm.rank, comm.world_size) == (rank, world)
    parts = [torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) for r in range(world)]
    assert torch.equal(comm.all_reduce(parts[rank].clone()), sum(parts))
    assert torch.equal(comm.all_gather(parts[rank], dim=-1), torch.cat(parts, dim=-1))
    assert torch.equal(comm.all_gather(parts[rank], dim=0), torch.cat(parts, dim=0))
    # rank r sends r + 1 rows to each rank d, row values 10 r + d
    send = [r + 1 for r in range(world)]
    x = torch.cat([torch.full((rank + 1, 2), 10.0 * rank + d) for d in range(world)])
    got = comm.all_to_all(x, [rank + 1] * world, send)
    want = torch.cat([torch.full((r + 1, 2), 10.0 * r + rank) for r in range(world)])
    assert torch.equal(got, want)
    t = torch.full((3,), float(rank))
    assert torch.equal(comm.broadcast(t), torch.zeros(3))
    assert comm.broadcast_object({"step": 7} if rank == 0 else None) == {"step": 7}


def test_two_ranks_collectives():
    run_ranks(_ranks_collectives, 2)


def test_one_rank_returns_inputs():
    comm = Communicator()
    x = torch.randn(2, 3)
    assert comm.all_reduce(x) is x and comm.all_gather(x) is x and comm.broadcast(x) is x
    assert comm.all_to_all(x, [2], [2]) is x and comm.broadcast_object(5) == 5
