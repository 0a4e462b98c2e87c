import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any kernel module
# is imported: on a machine without CUDA every Triton kernel runs in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparrow.devices import set_cpu_threads  # noqa: E402

# the suite keeps torch's own thread count (the machine's cores), shared out among pytest-xdist's workers (the
# default run: pyproject's addopts); LLM()'s default is tested in test_first_run
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
set_cpu_threads(max(1, torch.get_num_threads() // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cuda_cache(request):
    """After a GPU test its cached blocks go back to the device: pytest-xdist workers share one GPU, and each
    worker's allocator would otherwise keep the largest test's memory reserved for the rest of the run."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


_FAILURES = os.environ.get("SPARROW_TEST_FAILURES")  # a file: each failure's report appended as it happens
_IS_WORKER = False


def pytest_configure(config):
    global _IS_WORKER
    _IS_WORKER = hasattr(config, "workerinput")  # pytest-xdist: the controller alone writes the file


def pytest_runtest_logreport(report):
    """With SPARROW_TEST_FAILURES set (benchmarks/device_run.sh), a failed test's traceback is in that file at
    once, so a run stopped by its time limit still says what failed."""
    if _FAILURES and report.failed and not _IS_WORKER:
        with open(_FAILURES, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
