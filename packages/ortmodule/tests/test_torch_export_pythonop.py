"""Custom ``torch.autograd.Function`` calls on ORTMODULE_EXPORTER=torch_export
(``export/torch_export_python_op.py``): each call is the TorchScript frontend's PythonOp, whose
forward and backward run the user's Function in PyTorch, so the Function's own backward
trains, as in eager. Fallback is disabled (conftest)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.errors import ExportError

pytest.importorskip("onnxscript")

TORCH_EXPORT = DebugOptions(exporter="torch_export")


class _Squash(torch.autograd.Function):
    """``tanh(x * w) * k + shift[0]`` and either its row sums of squares (``rows``) or itself
    times ``shift[1]``; the backward scales x's gradient by ``boost``, so it is no derivative
    of the forward: an engine that differentiated the forward would give other gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        k: float,
        rows: bool,
        shift: tuple[float, float],
        boost: int,
        unused: None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert unused is None
        ctx.save_for_backward(x, w)
        ctx.k, ctx.rows, ctx.shift, ctx.boost = k, rows, shift, boost
        t = torch.tanh(x * w)
        y = t * k + shift[0]
        return y, (y * y).sum(-1) if rows else y * shift[1]

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, grad_z: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        t = torch.tanh(x * w)
        y = t * ctx.k + ctx.shift[0]
        if ctx.rows:
            grad_y = grad_y + 2 * y * grad_z.unsqueeze(-1)
        else:
            grad_y = grad_y + grad_z * ctx.shift[1]
        inner = grad_y * (1 - t * t) * ctx.k
        return ctx.boost * inner * w, (inner * x).sum(0), None, None, None, None, None


class _Twice(nn.Module):
    """One Function applied twice with other non-tensor arguments (and another output shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, rows = _Squash.apply(self.fc(x), self.w, 2.0, True, (0.5, 1.5), 3, None)
        z, scaled = _Squash.apply(y, self.w, 0.75, False, (-0.25, 2.0), 2, None)
        return rows.sum() + (z * scaled).mean()


def _compare_steps(make: type[nn.Module], shape: tuple[int, ...], steps: int = 3) -> ORTModule:
    """``steps`` SGD steps of eager and ORTModule from the same weights: losses, every
    parameter's gradient and the input's. Seeded: from some initial weights (``torch.manual_seed
    (3)``) ``_Twice``'s SGD steps diverge (input gradients 12, 29, 61), and by the third step
    eager and the engine are each 1.6e-3 off a float64 run, more than the tolerance apart."""
    torch.manual_seed(0)
    model = make()
    wrapped = ORTModule(make(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    ours = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    theirs = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(shape, generator=gen, requires_grad=True)
        y = x.detach().clone().requires_grad_(True)
        want, got = model(x), wrapped(y)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-4, atol=1e-5)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(
                wrapped.get_parameter(name).grad, parameter.grad, rtol=1e-4, atol=1e-5, msg=name
            )
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    return wrapped


def _python_ops(wrapped: ORTModule) -> list[str]:
    compiled = wrapped._runner.transitions.current(True, True)
    assert compiled is not None
    assert compiled.built.exported.config.frontend == "torch_export"  # type: ignore[union-attr]
    graph = compiled.built.exported.model.graph
    return [
        next(a.s.decode() for a in n.attribute if a.name == "func_name")
        for n in graph.node
        if n.op_type == "PythonOp"
    ]


def test_function_runs_its_own_backward() -> None:
    """Non-tensor arguments (float, bool, tuple, int, None), a tuple output, applied twice:
    both calls are PythonOps of the Function, and the gradients are its backward's."""
    wrapped = _compare_steps(_Twice, (3, 4))
    assert _python_ops(wrapped) == [f"{__name__}._Squash"] * 2
    assert wrapped._runner.transitions.builds == 1


class _Clamp(torch.autograd.Function):
    """``setup_context`` style, a non-differentiable second output and needs_input_grad."""

    @staticmethod
    def forward(x: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clamp(-limit, limit), (x.abs() > limit)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _x, limit = inputs
        clipped, outside = output
        ctx.mark_non_differentiable(outside)
        ctx.save_for_backward(outside)
        ctx.wants_x = ctx.needs_input_grad[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _outside: Any) -> tuple[Any, None]:
        (outside,) = ctx.saved_tensors
        assert ctx.wants_x
        # straight through, halved outside the limit (not clamp's derivative, which is 0)
        return torch.where(outside, grad * 0.5, grad), None


class _Outer(torch.autograd.Function):
    """A Function whose forward applies another (nested): it runs as it is inside the
    PythonOp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        clipped, _ = _Clamp.apply(x * 2, 1.0)
        return clipped + 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3


class _Both(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        clipped, outside = _Clamp.apply(h, 0.5)
        return (clipped * (1 + outside.float())).sum() + _Outer.apply(h).square().sum()


def test_setup_context_non_differentiable_and_nested_functions() -> None:
    wrapped = _compare_steps(_Both, (4, 5))
    assert sorted(_python_ops(wrapped)) == [f"{__name__}._Clamp", f"{__name__}._Outer"]


class _AddInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        return x.add_(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Dirty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AddInPlace.apply(self.fc(x))  # type: ignore[no-any-return]


def test_function_writing_its_argument_in_place_is_refused() -> None:
    """mark_dirty: the operator the call becomes writes no argument, so the write would be
    lost; refused, naming the Function and the way out."""
    wrapped = ORTModule(_Dirty(), TORCH_EXPORT)
    with pytest.raises(ExportError, match=r"_AddInPlace writes its argument in place.*torchscript"):
        wrapped(torch.randn(2, 3))


def test_switched_off_custom_autograd_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0: no PythonOp, and torch.export would keep only the
    forward (wrong gradients): refused, naming the Function and the switch."""
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    wrapped = ORTModule(_Twice(), TORCH_EXPORT)
    with pytest.raises(ExportError, match=r"_Squash.*ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0"):
        wrapped(torch.randn(3, 4))


class _TimesRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.rows = rows
        return x * rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.rows * 2, None


class _SizeArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TimesRows.apply(self.fc(x), x.shape[0]).sum()  # type: ignore[no-any-return]


def test_size_argument_is_guarded() -> None:
    """``x.shape[0]`` as an argument is a SymInt under torch.export: passed as the traced int,
    which fixes the dim, so another batch size exports again (not the old size, silently)."""
    model = _SizeArgument()
    wrapped = ORTModule(_SizeArgument(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    for rows in (2, 5, 2):
        x = torch.randn(rows, 3)
        want, got = model(x), wrapped(x)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(wrapped.module.fc.weight.grad, model.fc.weight.grad)
    assert wrapped._runner.transitions.builds == 2


class _ScaledBySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_forward_reading_a_value_is_refused() -> None:
    """Its output shapes come from its forward on fake tensors, which have no values."""

    class _ReadsValue(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _ScaledBySum.apply(x)  # type: ignore[no-any-return]

    wrapped = ORTModule(_ReadsValue(), TORCH_EXPORT)
    with pytest.raises(ExportError, match=r"_ScaledBySum could not run on torch.export's fake"):
        wrapped(torch.randn(2, 3, requires_grad=True))


def test_a_registered_exporter_is_said_to_be_passed_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``register_python_op_exporter`` handler writes TorchScript nodes: on this frontend the
    Function runs as itself, and an INFO line says so (no silently ignored registration)."""
    from ortmodule_exporter.python_op import registry

    name = f"{__name__}._Squash"
    registry.register_python_op_exporter(name, lambda g, node, *args: None)
    try:
        with caplog.at_level(logging.INFO, logger="ortmodule.exporter"):
            _compare_steps(_Twice, (3, 4), steps=1)
    finally:
        registry._SPECIAL.pop(name, None)
    said = [
        r.getMessage() for r in caplog.records if "register_python_op_exporter" in r.getMessage()
    ]
    assert said and name in said[0], said
