"""Tensor-parallel ranks 1..N-1: their processes, the step broadcast they follow, and their failures.

``LLM(model, tensor_parallel_size=N)`` runs in the calling process as rank 0 (scheduler, sampler, outputs) and
starts ``WorkerGroup``: N - 1 processes (torch.multiprocessing's spawn context; rank r on cuda:r with NCCL, or on
the CPU with gloo) that join the process group (``sparrow.distributed.init_distributed``, expert parallelism set
after it), build the same model with the same arguments (``build(device)``, a picklable callable: the layers read
``tp_rank()`` / ``tp_size()`` as they are built), make a ModelRunner exactly as rank 0's engine does (their KV
pools agree on the fewest blocks, their CUDA graphs cover the same buckets) and then follow
``worker_process.serve_steps``.

Each step rank 0 sends one pickled ``StepInputs`` (the step's rows after padding, whether and with what q it is a
graph replay, the LoRA slot writes since the last step) and, when the step is fed on the device, the fed ids as a
tensor; then every rank runs ``ModelRunner.execute`` on them: the same forward and logits calls in the same
order, whose collectives pair up. Workers drop their logits; rank 0 samples. The message ``SHUTDOWN`` ends them.

Failures: a worker that raises (loading or in a step) sends its traceback to rank 0 on a pipe and exits. Rank 0
checks the pipes and the processes before each step (``check``) and, when a collective or step raises, waits a
moment for a report (``guard``): either way it raises WorkerError naming the rank and the worker's error, and the
group is broken from then on (every later step raises; make a new LLM). A worker that stalls without dying is
caught by the collectives' timeout (``COLLECTIVE_TIMEOUT_S``). On CUDA a worker that dies inside a step leaves
rank 0 waiting on NCCL until that timeout or the next step's check.

Speculative decoding with a draft model is refused with tensor_parallel_size > 1 (the draft runner would run on
rank 0 alone while the target's collectives need every rank); n-gram speculation works (its verify steps are
target steps of k + 1 rows).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Callable

import torch

from sparrow.config import EngineConfig
from sparrow.engine.worker_process import COLLECTIVE_TIMEOUT_S, SHUTDOWN, WorkerSpec, rank_device, worker_main
from sparrow.errors import InvalidRequestError, WorkerError

log = logging.getLogger(__name__)

REPORT_WAIT_S = 5.0
"""How long rank 0 waits for a worker's report after a collective raised, before it re-raises the collective's
own error."""


def check_parallel(config: EngineConfig) -> None:
    """Raise InvalidRequestError for a tensor-parallel config sparrow cannot run: a draft-model speculative config,
    a CUDA device other than cuda:0, or fewer visible GPUs than ranks."""
    world = config.parallel.world_size
    if world == 1:
        return
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        raise InvalidRequestError("speculative_config with method 'draft_model' is not supported with "
                                  f"tensor_parallel_size={world} (use method 'ngram', or one rank)")
    if config.device.startswith("cuda"):
        if config.device not in ("cuda", "cuda:0"):
            raise InvalidRequestError(f"tensor_parallel_size={world} runs rank r on cuda:r: device must be 'cuda' "
                                      f"(or 'cuda:0'), got {config.device!r}")
        if torch.cuda.device_count() < world:
            raise InvalidRequestError(f"tensor_parallel_size={world} needs {world} GPUs, "
                                      f"{torch.cuda.device_count()} are visible")


@contextlib.contextmanager
def _main_not_rerun():
    """While a worker is spawned: the __main__ module's file and spec hidden, so the spawned interpreter does not
    run the calling script again (a plain script without an ``if __name__ == "__main__"`` guard would start
    another LLM there). The worker needs nothing from __main__: its entry point and the build live in modules."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__.pop(k) for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if saved:
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class WorkerGroup:
    """Rank 0's side of the group: the worker processes, the step broadcast and failure checks. Made by
    ``start``, which also makes this process rank 0 of the group (``sparrow.distributed.get_tp()``)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.procs: list = []
        self.conns: list = []
        self.broken: WorkerError | None = None
        """The failure that broke the group (later steps raise it again); None while it works."""
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, build: Callable[[str], torch.nn.Module], seed: int | None,
              timeout_s: float = COLLECTIVE_TIMEOUT_S) -> "WorkerGroup":
        """Spawn ranks 1..N-1 (N = config.parallel.world_size) building ``build(device)`` and join the group as rank
        0 (expert parallelism set as the config says). Raises InvalidRequestError (``check_parallel``), WorkerError
        when a worker fails before the group formed; InvalidRequestError also when another group is active in this
        process."""
        import torch.multiprocessing as mp

        from sparrow.distributed import get_tp
        from sparrow.distributed.state import local_init_method

        check_parallel(config)
        if get_tp().world_size > 1:
            raise InvalidRequestError("a tensor-parallel LLM is already running in this process: close() it first")
        group = cls(config.parallel.world_size)
        spec = WorkerSpec(config, build, local_init_method(), seed, timeout_s, torch.get_num_threads())
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, group.world_size):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, args=(rank, spec, send), name=f"sparrow-tp-rank{rank}",
                                   daemon=True)
                with _main_not_rerun():
                    proc.start()
                send.close()
                group.procs.append(proc)
                group.conns.append(recv)
            group._join(config, spec)
        except BaseException:
            group.shutdown()
            raise
        log.info("tensor parallel: %d ranks (%s)", group.world_size,
                 "NCCL" if config.device.startswith("cuda") else "gloo")
        return group

    def _join(self, config: EngineConfig, spec: WorkerSpec) -> None:
        """init_distributed as rank 0 on a thread, watching the workers meanwhile (one that fails before it joins
        would leave the rendezvous waiting for the whole timeout)."""
        from sparrow.distributed import init_distributed, set_expert_parallel

        failure: list[BaseException] = []

        def join():
            try:
                init_distributed(0, self.world_size, spec.init_method, rank_device(config, 0), spec.timeout_s)
            except BaseException as e:  # noqa: BLE001  (re-raised on the calling thread)
                failure.append(e)

        thread = threading.Thread(target=join, name="sparrow-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self.check()
        if failure:
            raise failure[0]
        set_expert_parallel(config.parallel.enable_expert_parallel, config.parallel.expert_dispatch)

    def _failure(self) -> WorkerError | None:
        """A worker's reported error or death, without waiting; None when all are well."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            report = None
            try:
                if conn.poll():
                    report = conn.recv()
            except (EOFError, OSError):
                report = None
            if report is not None:
                return WorkerError(f"tensor-parallel worker rank {rank} failed: {report}")
            if not proc.is_alive() and not self.closed:
                return WorkerError(f"tensor-parallel worker rank {rank} exited (exit code {proc.exitcode}) without "
                                   "reporting an error (its stderr says why; a build function defined in the "
                                   "__main__ script cannot reach a worker: define it in a module)")
        return None

    def check(self) -> None:
        """Raise WorkerError when the group is broken or a worker failed (non-blocking)."""
        if self.broken is None:
            self.broken = self._failure()
        if self.broken is not None:
            raise self.broken

    @contextlib.contextmanager
    def guard(self):
        """Around work with collectives (start-up, a step): checks the workers first; if the work raises, the group
        is broken and the error becomes the WorkerError of a worker that reports within REPORT_WAIT_S (else it
        propagates as it is)."""
        self.check()
        try:
            yield
        except BaseException as e:
            if isinstance(e, WorkerError):
                raise
            deadline = time.monotonic() + REPORT_WAIT_S
            failure = self._failure()
            while failure is None and time.monotonic() < deadline and not isinstance(e, KeyboardInterrupt):
                time.sleep(0.05)
                failure = self._failure()
            self.broken = failure or WorkerError(f"the tensor-parallel group is broken: rank 0 raised "
                                                 f"{type(e).__name__}: {e}")
            if failure is not None:
                raise failure from e
            raise

    def send(self, inputs, feed: torch.Tensor | None) -> None:
        """Broadcast one step to the workers: ``inputs`` (StepInputs; soft vectors moved to the CPU) and, when it
        is fed, ``feed`` [inputs.num_fed] int64 on rank 0's device."""
        from sparrow.distributed import get_tp

        rows = inputs.rows
        if any(v.device.type != "cpu" for v in rows.soft_vecs):
            rows.soft_vecs = [v.cpu() for v in rows.soft_vecs]
        comm = get_tp()
        comm.broadcast_object(inputs, 0)
        if feed is not None:
            comm.broadcast(feed.contiguous(), 0)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (the SHUTDOWN message when the group works, else terminate them), wait for them and
        leave the group; idempotent. Called by ``LLM.close``, when the LLM is garbage-collected and at exit."""
        if self.closed:
            return
        self.closed = True
        from sparrow.distributed import destroy_distributed, get_tp

        if self.broken is None and self._failure() is None and get_tp().world_size > 1:
            try:
                get_tp().broadcast_object(SHUTDOWN, 0)
            except Exception as e:  # noqa: BLE001  (a worker gone meanwhile: terminated below)
                log.warning("tensor parallel: the shutdown message failed (%s); terminating the workers", e)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if get_tp().world_size > 1:
            destroy_distributed()
