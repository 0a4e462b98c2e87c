"""Tensor and expert parallelism over ``torch.distributed``: the Communicator through which every collective
goes, this process's rank and the group's size, and the splitting of dimensions over the ranks."""
from sparrow.distributed.communicator import Communicator
from sparrow.distributed.state import destroy_distributed, divide, expert_parallel, get_tp, init_distributed, \
    set_expert_parallel, shard_range, tp_rank, tp_size

__all__ = ["Communicator", "destroy_distributed", "divide", "expert_parallel", "get_tp", "init_distributed",
           "set_expert_parallel", "shard_range", "tp_rank", "tp_size"]
