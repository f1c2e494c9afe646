"""The kernel choice (ORTMODULE_KERNEL_CHOICE) on the torch_export frontend: each covered
family's FX node becomes the ATen node its TorchScript symbolic writes where PyTorch's kernel
is chosen, and the model trains like eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.aten import kernel_choice
from ortmodule_exporter.aten.kernel_choice import choice, gelu, relu
from ortmodule_testing.parity import clone_model

TORCH_EXPORT = DebugOptions(exporter="torch_export")

#: the ATen operators of the covered families this model has (embedding is PyTorch's own)
FAMILIES = {
    kernel_choice.GELU,
    kernel_choice.RELU,
    kernel_choice.LAYER_NORM,
    kernel_choice.CROSS_ENTROPY,
    kernel_choice.CONV,
    kernel_choice.MAX_POOL2D,
    "embedding",
}


class Covered(nn.Module):
    """Every covered family on a value that needs its gradient: an embedding (with a padding
    row or not), LayerNorm, both GELUs, ReLU, a convolution of a computed image, 2-d max pooling
    and a cross-entropy on class indices."""

    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 16)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.head = nn.Linear(16 + 8, 5)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens))
        h = F.gelu(self.up(h))
        h = torch.relu(h) + F.gelu(h, approximate="tanh")
        image = h.reshape(-1, 1, 4, 4)
        pooled = F.max_pool2d(self.conv(image), 2).reshape(*h.shape[:-1], 8)
        logits = self.head(torch.cat([h, pooled], -1))
        return F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1))


def _aten_operators(model: ORTModule) -> set[str]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    return {
        next(a.s.decode() for a in n.attribute if a.name == "operator")
        for n in graph.built.exported.model.graph.node
        if n.op_type == "ATen"
    }


def _train_like_eager(padding_idx: int | None = None) -> ORTModule:
    torch.manual_seed(0)
    eager = Covered(padding_idx)
    ours = ORTModule(clone_model(eager), TORCH_EXPORT)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 20, (3, 4), generator=gen)
        labels = torch.randint(0, 5, (3, 4), generator=gen)
        losses = []
        for model, opt in zip((eager, ours), opts, strict=True):
            opt.zero_grad()
            loss = model(tokens, labels)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for (name, p_ours), p_eager in zip(
            ours.module.named_parameters(), eager.parameters(), strict=True
        ):
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-4, atol=1e-5, msg=name)
        for opt in opts:
            opt.step()
    return ours


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_torch_routes_every_covered_family(
    padding_idx: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    assert FAMILIES <= _aten_operators(_train_like_eager(padding_idx))


def test_engine_keeps_the_translation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    assert not FAMILIES & _aten_operators(_train_like_eager())


@pytest.mark.parametrize(("engine_us", "torch_us"), [(50.0, 10.0), (10.0, 50.0)])
def test_auto_takes_the_measured_route(
    engine_us: float, torch_us: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    monkeypatch.setattr(choice, "_DECISIONS", {})  # no decision of an earlier test
    monkeypatch.setattr(choice, "_SECONDS", {})
    sizes: list[int] = []

    def measure(numel: int, approximate: str = "none") -> tuple[float, float]:
        sizes.append(numel)
        return engine_us, torch_us

    monkeypatch.setattr(gelu, "measure_gelu", measure)
    monkeypatch.setattr(relu, "measure_relu_backward", measure)
    monkeypatch.setattr(relu, "measure_relu", lambda numel: (1.0, 2.0))  # forward: the engine's
    layers = [nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)]
    wrapped = ORTModule(nn.Sequential(*layers), TORCH_EXPORT)
    wrapped(torch.randn(5, 8)).sum().backward()
    route = "torch" if torch_us < engine_us else "engine"
    # the exported graph's dims are dynamic: GELU is classed at the calibration size, as the
    # TorchScript frontend classes it; ReLU by the size it ran with (5 x 32: class 128), as the
    # TorchScript frontend's trace records it
    decided = kernel_choice.decisions()
    assert decided[("gelu(none)", "Float", kernel_choice.CALIBRATION_NUMEL)] == (
        route,
        engine_us,
        torch_us,
    )
    assert decided[("relu_backward", "Float", 128)] == (route, engine_us, torch_us)
    assert sorted(sizes) == [128, kernel_choice.CALIBRATION_NUMEL]
    operators = _aten_operators(wrapped)
    assert (kernel_choice.GELU in operators) == (route == "torch")
    assert (kernel_choice.RELU in operators) == (route == "torch")


class Frozen(nn.Module):
    """A convolution of the model's input (which needs no gradient), a frozen LayerNorm, and a
    cross-entropy whose labels are mostly ignored: each stays on the engine under TORCH, as on
    the TorchScript frontend (an ATen node's gradient writes every input gradient it names, and
    label sparsity shrinks a loss only while it is the engine's node)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.LayerNorm(16).requires_grad_(False)
        self.head = nn.Linear(16, 5)

    def forward(self, image: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(image).reshape(-1, 16))
        return F.cross_entropy(self.head(h), labels)


def test_what_the_torchscript_side_keeps_on_the_engine_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    torch.manual_seed(0)
    eager = Frozen()
    ours = ORTModule(clone_model(eager), TORCH_EXPORT)
    image = torch.randn(2, 1, 4, 4)
    labels = torch.full((8,), -100)
    labels[0] = 3
    for model in (eager, ours):
        model(image, labels).backward()
    for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):
        if p_eager.requires_grad:
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-4, atol=1e-5)
    found = _aten_operators(ours)
    assert not {kernel_choice.CONV, kernel_choice.LAYER_NORM, kernel_choice.CROSS_ENTROPY} & found


def test_auto_asks_what_the_torchscript_frontend_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same decisions, by the same (operator, dtype, size class) keys, on both frontends:
    each family's FX-side decision reads the sizes the TorchScript trace records. Row sums are
    decided on the built gradient graph, which differs between the frontends."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (3, 4), generator=gen)
    labels = torch.randint(0, 5, (3, 4), generator=gen)
    asked = []
    for options in (DebugOptions(exporter="torchscript"), TORCH_EXPORT):
        monkeypatch.setattr(choice, "_DECISIONS", {})
        monkeypatch.setattr(choice, "_SECONDS", {})
        torch.manual_seed(0)
        ORTModule(Covered(None), options)(tokens, labels).backward()
        asked.append({k for k in kernel_choice.decisions() if not k[0].startswith("row_sum")})
    assert asked[1] == asked[0]
    assert {k[0].split("(")[0] for k in asked[0]} >= {
        "gelu",
        "relu_backward",
        "layer_norm",
        "cross_entropy",
        "embedding",
        "conv",
        "max_pool2d",
    }


class OtherForms(nn.Module):
    """The covered families' other FX forms: ``conv1d``, ``max_pool2d_with_indices`` (its
    indices an output of the ATen node) and ``native_layer_norm`` (its three outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.weight = nn.Parameter(torch.randn(18))
        self.bias = nn.Parameter(torch.randn(18))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.up(x).reshape(-1, 2, 6))  # (batch, 3, 6)
        pooled, indices = F.max_pool2d(h.reshape(-1, 1, 3, 6), 2, return_indices=True)
        y, mean, rstd = torch.ops.aten.native_layer_norm(
            h.flatten(1), [18], self.weight, self.bias, 1e-5
        )
        return (
            pooled.square().mean()
            + (indices % 3).sum()
            + y.square().mean()
            + mean.sum()
            + rstd.mean()
        )


def test_torch_routes_the_other_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    torch.manual_seed(0)
    eager = OtherForms()
    ours = ORTModule(clone_model(eager), TORCH_EXPORT)
    x = torch.randn(4, 6)
    losses = [model(x) for model in (eager, ours)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p_ours), p_eager in zip(
        ours.module.named_parameters(), eager.parameters(), strict=True
    ):
        torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-4, atol=1e-5, msg=name)
    found = _aten_operators(ours)
    assert {kernel_choice.CONV, kernel_choice.MAX_POOL2D, kernel_choice.LAYER_NORM} <= found
