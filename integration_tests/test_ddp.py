"""DistributedDataParallel(ORTModule(model)) on 2 CPU processes with gloo equals DDP(model)."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ortmodule import ORTModule
from ortmodule_testing.zoo import ZOO

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(rank: int, world: int, port: int, wrap: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        case = ZOO["gpt"]
        torch.manual_seed(0)
        model = case.make_model()
        if wrap:
            # spawned processes: set here, so a fallback cannot make this DDP against DDP
            os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
            model = ORTModule(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for step in range(STEPS):
            args, kwargs = case.make_batch(step * world + rank)
            loss = case.loss_fn(ddp(*args, **kwargs), args, kwargs)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if wrap:
            assert model._fallback.cause is None  # every step ran in the engine
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in ddp.module.state_dict().items()}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_over_ortmodule_matches_ddp_over_the_plain_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = {}
    for wrap in (False, True):
        out = str(tmp_path / f"wrap{wrap}.pt")
        mp.spawn(_train, args=(2, _free_port(), wrap, out), nprocs=2, join=True)
        results[wrap] = torch.load(out)
    assert list(results[True]) == list(results[False])
    for name, ref in results[False].items():
        torch.testing.assert_close(
            results[True][name], ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_wrong_wrapping_order_is_explained() -> None:
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(torch.nn.Linear(2, 2)))
        with pytest.raises(TypeError, match=r"DistributedDataParallel\(ORTModule\(model\)\)"):
            ORTModule(ddp)
    finally:
        dist.destroy_process_group()
