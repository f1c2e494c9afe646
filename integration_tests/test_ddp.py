"""DistributedDataParallel(ORTModule(model)) on 2 CPU processes with gloo equals DDP(model)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from ddp_parity import assert_wrapped_ddp_matches_plain, free_port, gloo_group

from ortmodule import ORTModule
from ortmodule_testing.zoo import ZOO

STEPS = 4


def _train(rank: int, world: int, port: int, wrap: bool, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
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


@pytest.mark.slow
def test_ddp_over_ortmodule_matches_ddp_over_the_plain_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert_wrapped_ddp_matches_plain(_train, tmp_path)


def test_wrong_wrapping_order_is_explained() -> None:
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(torch.nn.Linear(2, 2)))
        with pytest.raises(TypeError, match=r"DistributedDataParallel\(ORTModule\(model\)\)"):
            ORTModule(ddp)
    finally:
        dist.destroy_process_group()
