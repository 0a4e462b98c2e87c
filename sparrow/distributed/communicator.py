"""The one object every collective of a parallel model goes through (``torch.distributed`` underneath: NCCL on
CUDA, gloo on CPU). With one rank each collective returns its input unchanged and no process group exists, so
single-process code runs the same calls.

Collectives are issued in the same order on every rank (the model's layers call them in forward order; the
step broadcast comes first). Results of ``all_reduce`` are identical on all ranks (NCCL's and gloo's ring
reductions hand every rank the same sums), which keeps the ranks' sampled tokens equal.
"""
from __future__ import annotations

import torch


class Communicator:
    """Collectives over ``group`` (a ``torch.distributed`` ProcessGroup; None with ``world_size`` 1).

    ``rank`` / ``world_size``: this process's place in the group. Every method is a no-op returning its
    input when ``world_size`` is 1."""

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, device: torch.device | str = "cpu"):
        if world_size > 1 and group is None:
            raise ValueError("a Communicator of more than one rank needs a process group")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (x any shape and float dtype); returns x. CUDA-graph capturable
        under NCCL."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` (same shape on every rank) concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if x.is_cuda:  # NCCL: one buffer; gloo has no all_gather_into_tensor
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` [sum(send_counts), ...]: the first send_counts[0] go to rank 0, the next to rank 1, ...;
        returns [sum(recv_counts), ...]: recv_counts[r] rows from rank r, in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        out = torch.empty((sum(recv_counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (same shape and dtype everywhere); returns x."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src, group=self.group)
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        """Rank ``src``'s picklable ``obj`` on every rank (the others pass None); returns it."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src, group=self.group, device=self.device if self.device.type == "cuda"
                                   else None)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)
