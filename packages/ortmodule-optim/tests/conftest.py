"""A one-process DeepSpeed on CPU for the FP16_Optimizer tests (skipped without deepspeed)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from ortmodule_testing.deepspeed_cpu import DeepSpeedNotOnCpu, deepspeed_on_cpu


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """These tests use tiny tensors: with a busy CPU, a thread pool costs ten times the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def deepspeed_cpu() -> Iterator[ModuleType]:
    """DeepSpeed on its CPU accelerator with a gloo group of world size 1."""
    pytest.importorskip("deepspeed")
    try:
        with deepspeed_on_cpu() as deepspeed:
            yield deepspeed
    except DeepSpeedNotOnCpu as err:
        pytest.skip(str(err))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
