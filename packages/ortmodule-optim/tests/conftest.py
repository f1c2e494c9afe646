"""A one-process DeepSpeed on CPU for the FP16_Optimizer tests (skipped without deepspeed)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.distributed as dist


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
    saved = {k: os.environ.get(k) for k in ("DS_ACCELERATOR", "LOCAL_RANK")}
    # chosen when deepspeed is first imported
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["LOCAL_RANK"] = "0"
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        pytest.skip(f"deepspeed was imported earlier with accelerator {accelerator.device_name()}")
    patch = pytest.MonkeyPatch()
    # The shared-memory all-reduce kernel is JIT-compiled (a minute on a fresh machine) and only
    # serves several processes on one host; one process does not need it.
    patch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    # DeepSpeed asks oneDNN whether this CPU has fast fp16; torch computes fp16 on any CPU.
    patch.setattr(accelerator, "is_fp16_supported", lambda: True)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    try:
        yield deepspeed
    finally:
        patch.undo()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if started and dist.is_initialized():
            dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
