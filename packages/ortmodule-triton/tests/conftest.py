"""Triton chooses interpreter or GPU mode once, when first imported, so one test process runs
either the CPU tests (interpreter) or the GPU tests: ``ORTMODULE_TRITON_GPU_TESTS=1`` on a CUDA
machine runs the ``gpu``-marked ones, compiled; otherwise everything else runs interpreted."""

from __future__ import annotations

import os

import pytest
import torch

GPU_RUN = os.environ.get("ORTMODULE_TRITON_GPU_TESTS") == "1" and torch.cuda.is_available()
if not GPU_RUN:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """Tiny tensors: with a busy CPU, a thread pool costs more than the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config: pytest.Config) -> None:
    # masked-off lanes (loaded as 0) go through log/div in the interpreter's numpy and warn;
    # they are never stored
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_RUN:
        skip = pytest.mark.skip(
            reason="runs under Triton's interpreter: unset ORTMODULE_TRITON_GPU_TESTS"
        )
        for item in items:
            if "gpu" not in item.keywords:
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and ORTMODULE_TRITON_GPU_TESTS=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
