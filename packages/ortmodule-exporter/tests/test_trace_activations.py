"""The trace's real forward keeps no tensors for a backward, unless the forward reads them."""

from __future__ import annotations

import weakref

import torch
from conftest import assert_engine_matches_eager

from ortmodule_exporter import export


class _Watched(torch.nn.Module):
    """Notes, per call, whether autograd kept the input of ``sin`` for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.kept: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        ref = weakref.ref(h)
        y = h.sin()  # sin's backward reads h
        del h
        if torch.is_grad_enabled():
            self.kept.append(ref() is not None)
        return y.sum()


def test_the_trace_forward_keeps_no_saved_tensors() -> None:
    model = _Watched()
    model(torch.randn(4, 8))
    assert model.kept == [True]  # eager keeps h for sin's backward
    exported = export(model, (torch.randn(4, 8),), training=True, deepcopy=False)
    assert model.kept[1:] == [False]
    assert exported.output_schema.tensor_specs[0].requires_grad


class _GradInForward(torch.nn.Module):
    """Runs a backward of its own inside the forward: reads what autograd saved."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.detach().requires_grad_()
        (dz,) = torch.autograd.grad((z.sin() * z).sum(), z)
        return self.linear(dz.detach() * x).sum()


def test_a_forward_reading_saved_tensors_is_traced_keeping_them() -> None:
    torch.manual_seed(0)
    assert_engine_matches_eager(_GradInForward(), (torch.randn(3, 4, requires_grad=True),))


class _CatchesTheRead(torch.nn.Module):
    """Falls back to another value when its own backward fails: the trace must not take that
    path where eager does not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.detach().requires_grad_()
        try:
            (dz,) = torch.autograd.grad(z.sin().sum(), z)
        except Exception:  # noqa: BLE001 - the point of the test
            dz = torch.zeros_like(z)
        return self.linear(dz.detach() * x).sum()


def test_a_forward_catching_the_failed_read_is_traced_keeping_them() -> None:
    torch.manual_seed(0)
    assert_engine_matches_eager(_CatchesTheRead(), (torch.randn(3, 4, requires_grad=True),))
