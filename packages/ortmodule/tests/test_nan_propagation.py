"""NaN and Inf reach the same output and gradient elements as in eager (issue #36, item 7).

Each case runs the engine (fallback disabled) under the kernel choices ``auto`` and ``engine``
and compares, in the output, the input's gradient and every parameter's gradient, the NaN
positions and the Inf positions exactly and the finite values with fp32 tolerance (rtol 1e-4,
atol 1e-5). Measured before the fix (2026-11-26, 2-core CPU machine): ReLU with an MSE loss and
one NaN input element left 16 NaNs in the first weight's gradient (eager 128); ``hardtanh``,
``relu6``, ``clamp`` and ``maximum`` put NaN where eager has finite gradients; ``clamp(min=0)``
of an infinite input gave the largest finite float (eager: Inf).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule
from ortmodule_testing.zoo.mlp import MLP as MLP_ZOO

KERNEL_CHOICES = ("AUTO", "ENGINE")
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "hardtanh": F.hardtanh,
    "relu6": F.relu6,
    "clamp_both": lambda h: torch.clamp(h, -0.5, 0.5),
    "clamp_min": lambda h: torch.clamp(h, min=0),
    "clamp_max": lambda h: h.clamp_max(0.3),
    "clamp_min_tensor": lambda h: torch.clamp(h, min=torch.zeros(16)),
    "maximum": lambda h: torch.maximum(h, torch.zeros_like(h)),
    "minimum": lambda h: torch.minimum(torch.zeros_like(h), h),
    "minimum_broadcast": lambda h: torch.minimum(torch.tensor(0.0), h),
    "max_binary": lambda h: torch.max(h, torch.full_like(h, 0.1)),
    "maximum_broadcast_rows": lambda h: torch.maximum(h, torch.linspace(-1, 1, 16)),
    "where": lambda h: torch.where(h > 0, h, torch.zeros_like(h)),
    "gelu": F.gelu,
}


class MLP(nn.Module):
    def __init__(self, act: str, loss: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.act, self.loss = act, loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.b(ACTIVATIONS[self.act](self.a(x)))
        if self.loss == "mse":
            return F.mse_loss(out, target)
        return out.sum()


def assert_same_specials(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got.isnan(), want.isnan()), (
        f"{what}: NaN at {got.isnan().nonzero().tolist()}, eager {want.isnan().nonzero().tolist()}"
    )
    assert torch.equal(got.isposinf(), want.isposinf()), f"{what}: +Inf positions differ"
    assert torch.equal(got.isneginf(), want.isneginf()), f"{what}: -Inf positions differ"
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-5, msg=what)


def _same_step(
    eager: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    choice: str,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", choice)
    ours = ORTModule(copy.deepcopy(eager))
    x_e, x_o = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_e, loss_o = eager(x_e, target), ours(x_o, target)
    assert_same_specials(loss_o.detach(), loss_e.detach(), "loss")
    loss_e.backward()
    loss_o.backward()
    assert_same_specials(x_o.grad, x_e.grad, "x.grad")
    for (name, p_e), p_o in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert_same_specials(p_o.grad, p_e.grad, name)


def _case(
    act: str, loss: str, where: str, value: float
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP(act, loss)
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    if where == "input":
        x[1, 3] = value
    elif where == "target":
        target[2, 1] = value
    else:
        with torch.no_grad():
            model.a.weight[5, 2] = value
    return model, x, target


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["input", "target", "weight"])
@pytest.mark.parametrize("loss", ["sum", "mse"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_nan_and_inf_reach_the_gradients_eager_reaches(
    act: str, loss: str, where: str, value: float, choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "target" and loss == "sum":
        pytest.skip("the sum loss reads no target")
    if act == "gelu" and value == INF and choice == "ENGINE":
        # open (2026-11-26): the engine's GeluGrad at an infinite input gives +-Inf where eager's
        # cdf + x * pdf is inf * 0 = NaN
        pytest.skip("open: the engine's GeluGrad at +-Inf")
    model, x, target = _case(act, loss, where, value)
    _same_step(model, x, target, monkeypatch, choice)


class Ties(nn.Module):
    def __init__(self, largest: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.largest = largest

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        fn = torch.maximum if self.largest else torch.minimum
        return F.mse_loss(fn(self.a(x).round(), self.b(x).round()), target)


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("largest", [True, False], ids=["maximum", "minimum"])
def test_ties_and_nan_in_maximum_minimum_split_the_gradient_as_eager(
    largest: bool, choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounded operands tie often: eager gives each half the gradient there, and the whole
    gradient to both where one operand is NaN."""
    torch.manual_seed(0)
    model = Ties(largest)
    with torch.no_grad():
        model.a.weight.mul_(4)
        model.b.weight.mul_(4)
    x, target = torch.randn(5, 6), torch.randn(5, 6)
    x[2, 0] = NAN
    target[4, 3] = NAN
    _same_step(model, x, target, monkeypatch, choice)


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
def test_one_nan_input_element_in_the_zoo_mlp_gives_eager_nan_gradients(
    choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: the zoo MLP (Linear -> ReLU, twice) with the zoo's MSE loss against
    ``sin(x)`` and one NaN input element. Eager's first layer gradients are all NaN (512 and 32
    elements); the engine's ReluGrad had left 32 and 0."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", choice)
    torch.manual_seed(0)
    eager = MLP_ZOO(16, 8)
    ours = ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    x[1, 3] = NAN
    for model in (eager, ours):
        out = model(x)
        F.mse_loss(out, torch.sin(x[:, : out.shape[-1]])).backward()
    for (name, p_e), p_o in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert_same_specials(p_o.grad, p_e.grad, name)
    assert int(eager.body[0].weight.grad.isnan().sum()) == 512
