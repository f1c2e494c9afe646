"""Mixed precision on the CPU engine: torch.autocast (bfloat16, float16), GradScaler and models
cast to a low-precision dtype train as eager trains them, with fallback disabled (conftest).

Every operator on a bfloat16/float16 tensor runs PyTorch's kernel inside the engine, so outputs
equal eager's exactly; gradients agree to the tolerance of
:func:`ortmodule_testing.parity.assert_same_mixed_precision_training` (see docs/mixed_precision.md).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ortmodule import ORTModule
from ortmodule_testing.parity import (
    GRAD_RTOL,
    TrainRecord,
    assert_same_mixed_precision_training,
)

LOW = [torch.bfloat16, torch.float16]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _train(
    model: nn.Module,
    batches: list[torch.Tensor],
    context: Callable[[], Any] = contextlib.nullcontext,
    lr: float = 1e-3,
    sgd: bool = False,
) -> tuple[TrainRecord, list[torch.Tensor]]:
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=lr) if sgd else torch.optim.AdamW(params, lr=lr)
    losses, outputs, first = [], [], {}
    for step, x in enumerate(batches):
        optimizer.zero_grad()
        with context():
            y = model(x)
        outputs.append(y.detach().clone())
        loss = y.float().pow(2).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return TrainRecord(losses, first, state), outputs


def _batches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_autocast_outputs_equal_eager_and_training_matches(dtype: torch.dtype) -> None:
    model = _mlp()
    context = lambda: torch.autocast("cpu", dtype)  # noqa: E731
    eager, eager_out = _train(copy.deepcopy(model), _batches(), context)
    wrapped = ORTModule(copy.deepcopy(model))
    ours, our_out = _train(wrapped, _batches(), context)
    for got, want in zip(our_out, eager_out, strict=True):
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want)  # PyTorch's kernels, operator for operator
    assert_same_mixed_precision_training(eager, ours, param_atol=2 * 3 * 1e-3)
    assert wrapped._runner.exports == 1


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_a_model_cast_to_low_precision_trains(dtype: torch.dtype) -> None:
    # SGD: AdamW's eps (1e-8) is 0 in float16, and its first step divides 0 by 0
    model = _mlp().to(dtype)
    eager, eager_out = _train(copy.deepcopy(model), _batches(dtype), lr=0.1, sgd=True)
    ours, our_out = _train(ORTModule(copy.deepcopy(model)), _batches(dtype), lr=0.1, sgd=True)
    for got, want in zip(our_out, eager_out, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_RTOL)
    # SGD moves by lr * grad: the gradients' tolerance times lr, per step
    assert_same_mixed_precision_training(eager, ours, param_atol=3 * 0.1 * GRAD_RTOL)
    assert all(p.dtype == dtype for p in ours.final_state.values())


def test_entering_autocast_after_the_first_call_exports_again() -> None:
    wrapped = ORTModule(_mlp())
    x = torch.randn(4, 16)
    assert wrapped(x).dtype == torch.float32
    with torch.autocast("cpu", torch.bfloat16):
        y = wrapped(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert wrapped._runner.exports == 2
    assert wrapped(x).dtype == torch.float32  # the float32 graph again, not a third export
    assert wrapped._runner.exports == 2


class _Residual(nn.Module):
    """A float32 residual plus a bfloat16 branch: the sum is float32 (type promotion), and its
    gradient for the residual is the incoming gradient itself."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.inner = nn.Linear(16, 16)
        self.outer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.inner(self.norm(x))
        return h + self.outer(self.norm(h)).relu()


def test_gradient_handed_back_unchanged_by_pytorch_is_not_read_after_free() -> None:
    """Regression: autograd returns ``add``'s incoming gradient as the residual's gradient; the
    engine freed that buffer, and OPT under bfloat16 autocast got gradients 100 % off."""
    torch.manual_seed(0)
    model = _Residual()
    x = [torch.randn(2, 6, 16) for _ in range(3)]
    context = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    eager, _ = _train(copy.deepcopy(model), x, context)
    ours, _ = _train(ORTModule(copy.deepcopy(model)), x, context)
    assert_same_mixed_precision_training(eager, ours, param_atol=2 * 3 * 1e-3)


class _Indexed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).view(x.shape[0], 3, 8)
        return h[..., torch.tensor([-1]), :] * h[:, :2]  # index with None entries


def test_indexing_with_an_ellipsis_trains_in_bfloat16() -> None:
    torch.manual_seed(0)
    model = _Indexed()
    context = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    eager, eager_out = _train(copy.deepcopy(model), _batches(), context)
    ours, our_out = _train(ORTModule(copy.deepcopy(model)), _batches(), context)
    assert all(torch.equal(a, b) for a, b in zip(our_out, eager_out, strict=True))
    assert_same_mixed_precision_training(eager, ours, param_atol=2 * 3 * 1e-3)


def _scaler_run(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scales = []
    for x in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, model.state_dict()


def test_grad_scaler_skips_the_same_steps_as_eager() -> None:
    """float16 autocast with GradScaler: the scaled backward runs in the engine; a step whose
    gradients overflow (an input of 6e4 squares past float16's range) is skipped and the scale
    halved, as in eager; the others step and the scale grows."""
    batches = _batches()
    batches[1] = batches[1] * 6e4
    model = _mlp()
    eager_scales, eager_state = _scaler_run(copy.deepcopy(model), batches)
    wrapped = ORTModule(copy.deepcopy(model))
    scales, state = _scaler_run(wrapped, batches)
    assert scales == eager_scales
    assert scales[1] < scales[0]  # the overflow was seen and its step skipped
    for name, want in eager_state.items():
        torch.testing.assert_close(state[name], want, rtol=GRAD_RTOL, atol=1e-3, msg=name)
    assert wrapped._runner.exports == 1
