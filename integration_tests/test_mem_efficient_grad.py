"""ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT=1: gradients reach parameters one by one, as in eager."""

from __future__ import annotations

import os

import pytest
import torch
from ddp_parity import assert_wrapped_ddp_matches_plain, gloo_group

from ortmodule import ORTModule
from ortmodule_memory.grad_management import TRIGGER
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import ZOO


@pytest.fixture(autouse=True)
def _grad_mgmt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT", "1")


def _built(model: ORTModule):  # type: ignore[no-untyped-def]
    (graph,) = [value for _key, value in model._runner.transitions._slots.values()]
    return graph.built


def test_trains_like_eager_with_gradient_accumulation() -> None:
    case = ZOO["gpt"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2, grad_accum=2)
    wrapped = ORTModule(clone_model(model))
    assert_same_training(eager, train_steps(wrapped, case, steps=2, grad_accum=2), *case.tolerance)
    built = _built(wrapped)
    # the parameters left the graph inputs; the trigger's gradient is the only backward output
    assert TRIGGER in built.feed_names
    assert not set(built.feed_names) & {n for n, _ in wrapped.named_parameters()}
    assert built.fetch_names == [f"{TRIGGER}_grad"]


def test_parameter_hooks_fire_once_per_backward_with_the_gradient() -> None:
    case = ZOO["mlp"]
    model = case.build(seed=0)
    eager, wrapped = clone_model(model), ORTModule(clone_model(model))
    seen: dict[str, dict[str, list[torch.Tensor]]] = {"eager": {}, "ort": {}}
    for tag, m in (("eager", eager), ("ort", wrapped)):
        for name, p in m.named_parameters():
            p.register_hook(lambda g, n=name, t=tag: seen[t].setdefault(n, []).append(g.clone()))
            p.register_post_accumulate_grad_hook(
                lambda q, n=name, t=tag: seen[t].setdefault(n + ".acc", []).append(q.grad.clone())
            )
    args, kwargs = case.make_batch(0)
    for m in (eager, wrapped):
        case.loss_fn(m(*args, **kwargs), args, kwargs).backward()
    assert seen["ort"].keys() == seen["eager"].keys() and seen["eager"]
    for key, grads in seen["eager"].items():
        assert len(seen["ort"][key]) == len(grads) == 1, key
        torch.testing.assert_close(seen["ort"][key][0], grads[0], rtol=1e-4, atol=1e-5, msg=key)


def test_frozen_parameters_stay_inputs() -> None:
    case = ZOO["frozen"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2)
    wrapped = ORTModule(clone_model(model))
    assert_same_training(eager, train_steps(wrapped, case, steps=2), *case.tolerance)
    frozen = {n for n, p in wrapped.named_parameters() if not p.requires_grad}
    assert frozen and frozen <= set(_built(wrapped).feed_names)


def _train(rank: int, world: int, port: int, wrap: bool, out: str) -> None:
    os.environ["ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT"] = "1"
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        case = ZOO["mlp"]  # small: the test is about DDP's hooks, not the model
        torch.manual_seed(0)
        model = case.make_model()
        if wrap:
            model = ORTModule(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for step in range(2):
            args, kwargs = case.make_batch(step * world + rank)
            case.loss_fn(ddp(*args, **kwargs), args, kwargs).backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in ddp.module.state_dict().items()}, out)


@pytest.mark.slow
def test_ddp_with_gloo_matches_eager_ddp(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert_wrapped_ddp_matches_plain(_train, tmp_path)
