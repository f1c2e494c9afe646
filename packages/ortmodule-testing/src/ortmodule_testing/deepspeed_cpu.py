"""DeepSpeed on its CPU accelerator in this process, with a gloo group of world size 1.

    with deepspeed_on_cpu() as deepspeed:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adamw, config=cfg)

For tests of DeepSpeed's optimizers in one process; several ranks need several processes
(``integration_tests/deepspeed_stack_worker.py``). DeepSpeed is imported when this is entered,
not when the module is imported.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]

__all__ = ["DeepSpeedNotOnCpu", "deepspeed_on_cpu"]


class DeepSpeedNotOnCpu(RuntimeError):
    """DeepSpeed was imported earlier in this process with another accelerator."""


@contextmanager
def deepspeed_on_cpu() -> Iterator[ModuleType]:
    """Import DeepSpeed with ``DS_ACCELERATOR=cpu``, start a one-process gloo group (unless one
    is running), and undo the environment, the patches and the group on exit.

    Two patches, both about this CPU-only use: the shared-memory all-reduce kernel, which
    DeepSpeed JIT-compiles (a minute on a fresh machine) for several processes on one host, is
    not built; and DeepSpeed's question whether the CPU has fast fp16 (oneDNN's view) is answered
    yes, since torch computes fp16 on any CPU.
    """
    saved = {k: os.environ.get(k) for k in ("DS_ACCELERATOR", "LOCAL_RANK")}
    os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported
    os.environ["LOCAL_RANK"] = "0"
    started = False
    undo: list[tuple[Any, str, Any]] = []
    try:
        deepspeed = importlib.import_module("deepspeed")
        accelerator = importlib.import_module("deepspeed.accelerator").get_accelerator()
        if accelerator.device_name() != "cpu":
            raise DeepSpeedNotOnCpu(
                f"deepspeed was imported earlier with accelerator {accelerator.device_name()}; "
                "set DS_ACCELERATOR=cpu before anything imports it"
            )
        comm = importlib.import_module("deepspeed.comm.torch")
        patches: list[tuple[Any, str, Any]] = [
            (comm, "build_shm_op", lambda: None),
            (accelerator, "is_fp16_supported", lambda: True),
        ]
        for owner, name, value in patches:
            undo.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, value)
        started = not dist.is_initialized()
        if started:
            dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
        deepspeed.comm.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=False, verbose=False
        )
        yield deepspeed
    finally:
        for owner, name, value in reversed(undo):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        if started and dist.is_initialized():
            dist.destroy_process_group()


_MISSING = object()
