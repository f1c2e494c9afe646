"""Loss-scaled fp16 training of an ORTModule: FP16_Optimizer over DeepSpeed's fp16 optimizers
(fp32 master weights) and torch.amp.GradScaler with fp16 autocast, with FusedAdam or AdamW.

Each test trains the same stack twice from the same weights on the same batches, once on the
plain model and once on ``ORTModule(model)``, through steps whose gradients overflow: the first
steps under a 2**20 loss scale (the scaled gradients pass fp16's 65504 and the infinities go
through the engine's backward) and two steps with an inf loss. Both runs must skip the same steps and move the loss
scale the same way (down and up again), and the parameters, fp32 masters included, must be
equal. Equal, not close: every operator on an fp16 tensor runs PyTorch's kernel in the engine and
its backward is autograd's, and this model uses no tensor twice, so the engine sums no gradient
of its own; the gradients are eager's bit for bit (measured 2026-11-26: max abs diff 0 after 12
steps in every case here).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ortmodule import FP16_Optimizer, FusedAdam, ORTModule
from ortmodule_testing.deepspeed_cpu import deepspeed_on_cpu

INF_STEPS = (7, 10)
STEPS = 12


@pytest.fixture(scope="module")
def deepspeed() -> Iterator[ModuleType]:
    with deepspeed_on_cpu() as module:
        yield module


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: on a busy 2-core machine a thread pool costs more than the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 2))


def batches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=gen).to(dtype) for _ in range(STEPS)]


def loss_at(step: int, out: torch.Tensor) -> torch.Tensor:
    loss = out.float().pow(2).mean()
    return loss * float("inf") if step in INF_STEPS else loss


def _skips_and_scale_moves(history: list[tuple[bool, float]]) -> None:
    skipped = [step for step, (overflow, _) in enumerate(history) if overflow]
    assert set(INF_STEPS) <= set(skipped) and skipped[0] < min(INF_STEPS), history
    scales = [scale for _, scale in history]
    moves = [b - a for a, b in itertools.pairwise(scales)]
    assert min(moves) < 0 < max(moves), f"the loss scale should fall and grow: {scales}"


INNER: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "FusedAdam": lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}


def _deepspeed_fp16(
    deepspeed: ModuleType, fused: bool, inner: str, model: nn.Module
) -> tuple[list[tuple[bool, float]], Any]:
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer as Fused
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer as Unfused

    optimizer = FP16_Optimizer(
        (Fused if fused else Unfused)(
            INNER[inner](model.parameters()),
            dynamic_loss_scale=True,
            dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 2, "min_scale": 1.0},
            verbose=False,
        )
    )
    history = []
    for step, x in enumerate(batches(torch.float16)):
        optimizer.zero_grad()
        optimizer.backward(loss_at(step, model(x)))
        overflow = optimizer.step()
        history.append((bool(overflow), float(optimizer.loss_scale_config.cur_scale)))
    return history, optimizer


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("fused", [True, False], ids=["FP16_Optimizer", "FP16_UnfusedOptimizer"])
def test_fp16_optimizer_with_fp32_masters_trains_as_without_ortmodule(
    deepspeed: ModuleType, fused: bool, inner: str
) -> None:
    """An fp16 model; DeepSpeed's FP16_Optimizer (one flat fp32 master per group) or
    FP16_UnfusedOptimizer (an fp32 master per parameter) around FusedAdam or AdamW, wrapped in
    ortmodule's FP16_Optimizer."""
    base = tiny().half()
    plain = copy.deepcopy(base)
    ref_history, ref_opt = _deepspeed_fp16(deepspeed, fused, inner, plain)
    wrapped = ORTModule(copy.deepcopy(base))
    history, opt = _deepspeed_fp16(deepspeed, fused, inner, wrapped)

    assert wrapped._runner.exports == 1
    assert history == ref_history
    _skips_and_scale_moves(history)
    masters = [g["params"] for g in opt.wrapped.optimizer.param_groups]
    ref_masters = [g["params"] for g in ref_opt.wrapped.optimizer.param_groups]
    for got_group, want_group in zip(masters, ref_masters, strict=True):
        for got, want in zip(got_group, want_group, strict=True):
            assert got.dtype == torch.float32
            assert torch.equal(got, want)
    for (name, want), got in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert got.dtype == torch.float16
        assert torch.equal(got, want), name


def _grad_scaler_run(model: nn.Module) -> tuple[list[tuple[bool, float]], list[float]]:
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    history, losses = [], []
    for step, x in enumerate(batches()):
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.float16):
            out = model(x)
        loss = loss_at(step, out)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        history.append((scaler.get_scale() < before, scaler.get_scale()))
        losses.append(float(loss.detach()))
    return history, losses


def test_grad_scaler_autocast_and_fused_adam() -> None:
    """fp32 parameters (the master weights), fp16 autocast, GradScaler, FusedAdam."""
    base = tiny()
    plain = copy.deepcopy(base)
    ref_history, ref_losses = _grad_scaler_run(plain)
    wrapped = ORTModule(copy.deepcopy(base))
    history, losses = _grad_scaler_run(wrapped)

    assert wrapped._runner.exports == 1
    assert history == ref_history
    _skips_and_scale_moves(history)
    assert (
        losses == ref_losses
    )  # forward outputs under autocast are PyTorch's, operator for operator
    for (name, want), got in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
