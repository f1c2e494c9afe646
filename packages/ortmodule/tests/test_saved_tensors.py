"""Tensors a custom ``autograd.Function`` keeps for backward stay valid under the engine.

The engine plans its buffers without knowing that PyTorch still holds some of them: an
elementwise node after a PythonOp may write its result into the PythonOp's output buffer (or
input buffer) in place. Each case here trains a few steps under ORTModule (fallback disabled by
the conftest) and under eager from the same weights and compares every gradient; each failed
before saved tensors were protected (issue #13, item 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter.python_op import runner as python_op_runner
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo.registry import ZooCase


class ScaledTanh(torch.autograd.Function):
    """Saves its own output (the case of issue #13)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float) -> torch.Tensor:
        y = torch.tanh(x) * s
        ctx.save_for_backward(y)
        ctx.s = s
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        return gy * (ctx.s - y * y / ctx.s), None


class Square(torch.autograd.Function):
    """Saves its input, which the graph also feeds to later nodes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * gy


class KeepsAttribute(torch.autograd.Function):
    """Keeps its output as a plain ``ctx`` attribute instead of ``save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x)
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> torch.Tensor:
        return gy * ctx.y * (1 - ctx.y)


class DoubleInPlace(torch.autograd.Function):
    """Writes its input in place (``mark_dirty``) and saves the result."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2).tanh_()
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return gy * 2 * (1 - y * y)


class FlatView(torch.autograd.Function):
    """Returns a view of its input and saves a view of its output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y.view(-1))
        ctx.shape = x.shape
        return y.view(x.shape[0], -1, 2)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> torch.Tensor:
        (flat,) = ctx.saved_tensors
        y = flat.view(ctx.shape)
        return gy.reshape(ctx.shape) * (1 - y * y)


class Net(torch.nn.Module):
    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.body(self.fc1(x)).reshape(x.shape[0], 32))


def _saved_output(h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(ScaledTanh.apply(h, 1.7)) * 0.5 + 0.75


def _saved_input(h: torch.Tensor) -> torch.Tensor:
    # h's last reader is the Sigmoid after the Function: its buffer is free to reuse in place
    return Square.apply(h) + torch.sigmoid(h)


def _attribute(h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(KeepsAttribute.apply(h)) * 2.0


def _dirty(h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(DoubleInPlace.apply(h * 1.0)) - 0.25


def _views(h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(FlatView.apply(h)) * 3.0


def _used_twice(h: torch.Tensor) -> torch.Tensor:
    a = torch.sigmoid(ScaledTanh.apply(h, 1.7))
    b = torch.sigmoid(ScaledTanh.apply(a, 0.9))
    return a * b


BODIES = {
    "saved_output": _saved_output,
    "saved_input": _saved_input,
    "ctx_attribute": _attribute,
    "mark_dirty": _dirty,
    "views": _views,
    "used_twice": _used_twice,
}


def _sgd(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _case(body: Callable[[torch.Tensor], torch.Tensor]) -> ZooCase:
    def batch(step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)),), {}

    def loss(out: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
        return out.sum()

    return ZooCase("saved_tensors", lambda: Net(body), batch, loss)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_tensors_kept_for_backward_stay_valid(name: str) -> None:
    # three steps: the first call of a PythonOp copies its inputs, later calls do not
    case = _case(BODIES[name])
    pending = python_op_runner.live_contexts()  # other tests may leave some behind
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, 3, _sgd)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, case, 3, _sgd)
    assert wrapped._fallback.cause is None
    assert_same_training(eager, ours)
    assert python_op_runner.live_contexts() == pending


class Scale(torch.autograd.Function):
    """Keeps no tensor for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float) -> torch.Tensor:
        ctx.s = s
        return x * s

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gy * ctx.s, None


def test_only_kept_tensors_are_copied() -> None:
    # an output nothing keeps goes to the engine as the Function returned it; a saved output
    # costs one copy per call
    before = python_op_runner.protective_copies()
    wrapped = ORTModule(Net(lambda h: torch.sigmoid(Scale.apply(h, 2.0))))
    for _ in range(2):
        wrapped(torch.randn(4, 16)).sum().backward()
    assert python_op_runner.protective_copies() == before
    wrapped = ORTModule(Net(_saved_output))
    for _ in range(2):
        wrapped(torch.randn(4, 16)).sum().backward()
    assert python_op_runner.protective_copies() == before + 2


class SometimesSaves(torch.autograd.Function):
    """Saves its input only once ``save`` is set: the runner cannot know to copy it."""

    save = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        if SometimesSaves.save:
            ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> torch.Tensor:
        return gy * 2


def test_a_function_that_starts_saving_an_argument_later_is_a_clear_error() -> None:
    from ortmodule_exporter.callback_errors import user_errors

    SometimesSaves.save = False
    wrapped = ORTModule(Net(lambda h: torch.sigmoid(SometimesSaves.apply(h))))
    wrapped(torch.randn(4, 16)).sum().backward()
    SometimesSaves.save = True
    try:
        with pytest.raises(RuntimeError, match=r"SometimesSaves.forward kept argument\(s\) \[0\]"):
            with user_errors():
                wrapped(torch.randn(4, 16)).sum().backward()
    finally:
        SometimesSaves.save = False
