"""The trust cases of issue #40 under ORTMODULE_EXPORTER=torch_export: each gives eager's result
or a clear error. A data-dependent branch and a new sequence length are in
test_torch_export_frontend.py; a Python scalar read from a tensor and an input written in place
are here. Fallback is disabled (conftest), so every step ran in the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.errors import ExportError
from ortmodule_testing.parity import clone_model

pytest.importorskip("onnxscript")

TORCH_EXPORT = DebugOptions(exporter="torch_export")


class _ScaledByMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * float(y.max())  # a Python number read from the data


def test_a_python_scalar_read_from_a_tensor_is_a_clear_error() -> None:
    """The TorchScript trace would bake the first call's value in (it guards it); torch.export
    cannot capture it and says what to do instead."""
    wrapped = ORTModule(_ScaledByMax(), TORCH_EXPORT)
    with pytest.raises(
        ExportError, match=r"reads as a Python value.*ORTMODULE_EXPORTER=torchscript"
    ):
        wrapped(torch.randn(3, 4))


class _Accumulates(nn.Module):
    """Writes a running sum into a tensor the caller passes and keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        total.add_(y.detach().sum(0))
        return y.square().mean()


def test_an_input_written_in_place_is_written_on_every_step() -> None:
    torch.manual_seed(0)
    model = _Accumulates()
    ref, wrapped = clone_model(model), ORTModule(clone_model(model), TORCH_EXPORT)
    want, got = torch.zeros(4), torch.zeros(4)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(3, 4, generator=gen)
        loss_ref, loss = ref(x, want), wrapped(x, got)
        loss_ref.backward()
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
        # the caller's tensor holds every step's sum, as in eager
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    for p, q in zip(ref.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    assert wrapped._runner.transitions.builds == 1, wrapped._runner.transitions.history


class _Detached(nn.Module):
    """Reads of a layer's output without grad (``detach``, ``torch.no_grad``,
    ``set_grad_enabled(False)``) beside one with grad."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "detach":
            cut = self.a(x).detach()
        elif self.how == "no_grad":
            with torch.no_grad():
                cut = torch.tanh(self.a(x))
        else:
            with torch.set_grad_enabled(False):
                cut = self.a(x) * 2
        return self.b(cut * self.a(x) + cut).sum()


@pytest.mark.parametrize("how", ["detach", "no_grad", "set_grad_enabled"])
def test_a_value_read_without_grad_cuts_the_gradient(how: str) -> None:
    """The translator's decompositions drop ``detach`` and inline a no-grad body: the engine
    differentiated through both (``a.weight``'s gradient was twice eager's). A TorchScript
    export runs first: its grad-switch recorder, left in place, had hidden the no-grad region
    from torch.export (order-dependent: the test passed alone and failed in the suite)."""
    ORTModule(nn.Linear(3, 3))(torch.randn(2, 3)).sum().backward()
    torch.manual_seed(0)
    model = _Detached(how)
    wrapped = ORTModule(clone_model(model), TORCH_EXPORT)
    x = torch.randn(2, 3)
    for _ in range(2):
        model(x).backward()
        wrapped(x).backward()
    for name, parameter in model.named_parameters():
        got = wrapped.module.get_parameter(name).grad
        torch.testing.assert_close(got, parameter.grad, rtol=1e-5, atol=1e-6, msg=name)
