"""DDP over ORTModule against DDP over the plain model: two gloo processes each, same batches."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: ``train(rank, world, port, wrap, out)``: rank 0 saves the final state dict to ``out``
Train = Callable[[int, int, int, bool, str], None]


def free_port() -> int:
    """A free TCP port on the loopback interface for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """A spawned worker's gloo process group, torn down only once every rank is done with it.

    A rank once aborted ("terminate called without an active exception", SIGABRT) in CI and
    once in about 20 local pytest runs of the mem-efficient-gradient DDP test, never in about
    100 spawns outside pytest. The barrier keeps a rank from destroying the group while another
    still uses it; faulthandler prints the worker's Python stack should one abort again.
    """
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def assert_wrapped_ddp_matches_plain(train: Train, tmp_path: Path, world: int = 2) -> None:
    """Run ``train`` spawned over ``world`` processes without and with ORTModule; compare every
    parameter and buffer at rtol 1e-4, atol 1e-5."""
    results = {}
    for wrap in (False, True):
        out = str(tmp_path / f"wrap{wrap}.pt")
        mp.spawn(train, args=(world, free_port(), wrap, out), nprocs=world, join=True)
        results[wrap] = torch.load(out)
    assert list(results[True]) == list(results[False])
    for name, ref in results[False].items():
        torch.testing.assert_close(
            results[True][name], ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
