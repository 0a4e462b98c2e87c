"""A tensor-parallel worker process (rank 1..N-1; ``sparrow.engine.workers`` starts it and says how the group
works): join the group, build the model and the ModelRunner rank 0 builds, then run each step rank 0 broadcasts
(``serve_steps``) until SHUTDOWN. Any exception is sent to rank 0 on a pipe before the process exits; the process
also exits when rank 0's process is gone."""
from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from sparrow.config import EngineConfig

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a collective (the group's rendezvous included) waits for a missing rank before it raises."""
SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build the runner rank 0 builds (picklable: it crosses the spawn)."""

    config: EngineConfig
    """Rank 0's engine config (each rank uses its own device)."""
    build: Callable[[str], torch.nn.Module]
    """build(device) -> the loaded model, on this rank's device."""
    init_method: str
    """The group's rendezvous (``sparrow.distributed.state.local_init_method``)."""
    seed: int | None
    """torch.manual_seed before building, as on rank 0 (None: not seeded)."""
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    cpu_threads: int = 1
    """torch's CPU threads on a CPU rank: rank 0's count."""


def rank_device(config: EngineConfig, rank: int) -> str:
    """The device of ``rank``: cuda:rank on CUDA, else the CPU."""
    return f"cuda:{rank}" if config.device.startswith("cuda") else "cpu"


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """A worker process: join the group, build the model and runner, follow the steps; report any error on
    ``conn`` (then exit without waiting for the group's teardown)."""
    from sparrow.distributed import destroy_distributed, init_distributed, set_expert_parallel

    _exit_with_parent()
    try:
        config = spec.config
        device = rank_device(config, rank)
        if device == "cpu":
            from sparrow.devices import set_cpu_threads

            set_cpu_threads(spec.cpu_threads)
        comm = init_distributed(rank, config.parallel.world_size, spec.init_method, device, spec.timeout_s)
        set_expert_parallel(config.parallel.enable_expert_parallel, config.parallel.expert_dispatch)
        if spec.seed is not None:
            torch.manual_seed(spec.seed)
        runner = _build_runner(config.replace(device=device), spec.build(device))
        serve_steps(runner, comm)
    except BaseException as e:  # noqa: BLE001  (reported to rank 0, whatever it is)
        text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            conn.send(text[-20000:])  # well under a pipe's buffer: never blocks on a rank 0 that is not reading
            conn.close()
        finally:
            os._exit(1)
    destroy_distributed()
    conn.close()


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """A thread that ends this worker when rank 0's process is gone (killed without a shutdown): no orphan waits
    out a collective's timeout."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        while parent.is_alive():
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="sparrow-tp-parent-watch", daemon=True).start()


def _build_runner(config: EngineConfig, model: torch.nn.Module):
    from sparrow.engine.model_runner import ModelRunner, graph_query_lens

    return ModelRunner(config, model, graph_query_lens(config))


def serve_steps(runner, comm) -> None:
    """A worker's loop: receive each step's StepInputs (and fed ids) from rank 0 and run ``runner.execute`` on
    them, until SHUTDOWN."""
    while True:
        inputs = comm.broadcast_object(None, 0)
        if inputs == SHUTDOWN:
            return
        feed = None
        if inputs.num_fed:
            feed = comm.broadcast(torch.empty(inputs.num_fed, dtype=torch.int64, device=runner.device), 0)
        if inputs.lora_slots:
            runner.lora.replay_slot_writes(inputs.lora_slots)
        runner.execute(inputs, feed)


