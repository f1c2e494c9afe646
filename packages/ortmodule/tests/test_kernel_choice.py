"""Per-operator kernel choice (ORTMODULE_KERNEL_CHOICE): GELU on PyTorch's kernels inside the
engine trains like eager, and AUTO picks whichever route it measured faster."""

from __future__ import annotations

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter.aten import kernel_choice
from ortmodule_testing.parity import clone_model


class GeluMLP(torch.nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.act = torch.nn.GELU(approximate=approximate)
        self.down = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _ops(model: ORTModule) -> list[str]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    return [
        next((a.s.decode() for a in n.attribute if a.name == "operator"), n.op_type)
        for n in graph.built.exported.model.graph.node
    ]


def _train_both(approximate: str) -> ORTModule:
    torch.manual_seed(0)
    eager = GeluMLP(approximate)
    ours = ORTModule(clone_model(eager))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ours)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 8, generator=gen)
        for model, opt in zip((eager, ours), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
        for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()
    return ours


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_on_torch_kernels_trains_like_eager(
    approximate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    assert kernel_choice.GELU in _ops(_train_both(approximate))


def test_engine_keeps_its_own_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    assert kernel_choice.GELU not in _ops(_train_both("none"))


@pytest.mark.parametrize(
    ("engine_us", "torch_us", "route"), [(50.0, 10.0, "torch"), (10.0, 50.0, "engine")]
)
def test_auto_takes_the_faster_route_and_measures_once(
    engine_us: float, torch_us: float, route: str
) -> None:
    kernel_choice.configure_kernel_choice("auto")
    calls: list[int] = []

    def measure(numel: int) -> tuple[float, float]:
        calls.append(numel)
        return engine_us, torch_us

    op = f"test-op-{route}"
    assert kernel_choice.choose(op, "Float", 3000, measure) == route
    assert kernel_choice.choose(op, "Float", 4000, measure) == route  # same size class
    assert calls == [4096]
    assert kernel_choice.decisions()[(op, "Float", 4096)] == (route, engine_us, torch_us)
    kernel_choice.configure_kernel_choice("engine")  # what the process had before


def test_measurement_times_both_kernels() -> None:
    engine_us, torch_us = kernel_choice.measure_gelu(1 << 12)
    assert engine_us > 0 and torch_us > 2 * kernel_choice.ATEN_NODE_US


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel choice mode must be one of"):
        kernel_choice.configure_kernel_choice("fastest")
