"""DDP over ORTModule against DDP over the plain model: two gloo processes each, same batches."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

#: ``train(rank, world, port, wrap, out)``: rank 0 saves the final state dict to ``out``
Train = Callable[[int, int, int, bool, str], None]


def free_port() -> int:
    """A free TCP port on the loopback interface for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
