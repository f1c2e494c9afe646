"""``detach()`` and ``torch.no_grad()`` inside a forward cut the gradient in the engine too.

The exporter used to erase both: the engine differentiated through ``h.detach()`` and through
the steps of a recurrence run under ``no_grad`` (the Hierarchical Reasoning Model's
``L_bp_cycles``), and the gradients were silently those of a graph without the cut.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engine_matches_eager
from torch import nn

from ortmodule_exporter import export
from ortmodule_exporter.aten import executor as aten_executor
from ortmodule_exporter.aten import gradients as custom_gradients
from ortmodule_exporter.aten.executor import ATEN_DOMAIN


@pytest.fixture(autouse=True)
def _aten() -> None:
    # float64 and bfloat16 cuts are ATen nodes the engine runs through PyTorch
    aten_executor.install()
    custom_gradients.install_gradients()


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.lin(h * h.detach() + (2 * h).detach())


class NoGradSteps(nn.Module):
    """A recurrence whose first steps run without grad, the last one with it."""

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(x)
        with torch.no_grad():
            for _ in range(2):
                z = torch.tanh(self.step(z + x))
            z = z * 2
        return torch.tanh(self.step(z + x))


class NoGradConv(nn.Module):
    """The tracer records ``aten::_convolution`` below autograd (its traced type never requires
    grad): a cut must follow the grad mode, not that type, and leave the outer conv trainable."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = self.conv(x)
        return self.conv(z + x) * self.conv(x)


class NoGradOnBuffers(nn.Module):
    """``no_grad`` over values that never depend on a trainable input (a rotary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            table = torch.cos(self.freq * 0.5)
        return self.lin(x) * table + torch.zeros_like(x)


class StackedSteps(nn.Module):
    """A loop's steps through ``torch.stack`` (the trace reads them as a list), then cut: the
    list lost track of the parameter, no cut was made, and the engine's gradient went through
    the ``detach`` too (twice eager's; fuzz seed 42939)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.stack([x.select(1, i) * self.w * (i + 1) for i in range(x.shape[1])], 1)
        with torch.no_grad():
            smooth = torch.tanh(steps)
        return steps * steps.detach() + smooth


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("module_cls", [Detached, NoGradSteps, NoGradConv, StackedSteps])
def test_gradient_is_cut_where_eager_cuts_it(module_cls: type, dtype: torch.dtype) -> None:
    if module_cls is NoGradConv and dtype != torch.float32:
        pytest.skip("the CPU engine has no float64 or bfloat16 Conv kernel")
    if module_cls is StackedSteps and dtype == torch.float64:
        pytest.skip("the CPU engine's Concat gradient (SplitTraining) has no float64 kernel")
    torch.manual_seed(0)
    module = module_cls().to(dtype)
    shape = (3, 2, 4) if module_cls is NoGradConv else (3, 4)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    assert_engine_matches_eager(module, (x,), **tol)


def _cuts(module: nn.Module, x: torch.Tensor) -> int:
    model = export(module, (x,), training=True).model
    batch_norms = sum(n.op_type == "BatchNormalization" for n in model.graph.node)
    aten = sum(n.domain == ATEN_DOMAIN for n in model.graph.node)
    return batch_norms + aten


def test_no_cut_where_no_gradient_could_flow() -> None:
    """A ``no_grad`` block over buffers, and ``zeros_like`` of a trainable value (its value
    depends on no input), get no stop-gradient: it would cost a pass for nothing."""
    torch.manual_seed(0)
    module = NoGradOnBuffers()
    x = torch.randn(3, 4, requires_grad=True)
    assert _cuts(module, x) == 0
    assert_engine_matches_eager(module, (x,))
    assert _cuts(NoGradSteps(), x) == 1
