"""Model builders for the tensor-parallel tests (``LLM.from_builder``): importable, so the spawned ranks reach them.
The failure injection lives here, in the tests, not in sparrow."""
from __future__ import annotations

import torch

from sparrow.distributed import tp_rank
from sparrow.llm import load_model_module


def load_fp32(path: str, device: str) -> torch.nn.Module:
    return load_model_module(path, torch.float32, None, False, device)


def fail_to_load_on_workers(path: str, device: str) -> torch.nn.Module:
    """Rank 0 loads ``path``; every other rank raises (a load error only the worker meets)."""
    if tp_rank() != 0:
        raise RuntimeError(f"injected load failure on rank {tp_rank()}")
    return load_fp32(path, device)


def fail_in_step_on_workers(path: str, device: str, steps: int = 3) -> torch.nn.Module:
    """The model of ``path``; on ranks other than 0 its forward raises from the ``steps``-th call on."""
    model = load_fp32(path, device)
    if tp_rank() != 0:
        calls = [0]

        def hook(module, args):
            calls[0] += 1
            if calls[0] >= steps:
                raise RuntimeError(f"injected step failure on rank {tp_rank()}")

        model.register_forward_pre_hook(hook)
    return model
