"""A forward that writes a parameter in place (``nn.Embedding(max_norm=...)``, an in-place op on
a weight under ``torch.no_grad()``) or replaces it is refused at export: the engine takes
parameters as inputs and would not make the write, so its losses, gradients and weights would
silently differ from eager's (before the refusal, a renormalizing embedding's loss was already
off at the first step). The refusal names the parameter; under the default policy PyTorch
runs the module and training matches eager's exactly. Both frontends."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.errors import ExportError

FRONTENDS = [
    "torchscript",
    pytest.param(
        "torch_export",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("onnxscript") is None, reason="needs onnxscript"
        ),
    ),
]


class ScaledInPlace(nn.Module):
    """Halves its weight in place at every call, outside autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.mul_(0.5)
        return self.linear(x).square().sum()


class MaxNormEmbedding(nn.Module):
    """nn.Embedding with max_norm renormalizes the rows it looks up, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4, max_norm=0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).square().sum()


class Replaced(nn.Module):
    """Gives its weight a new Parameter at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight = nn.Parameter(self.weight.detach() * 0.5)
        return (x @ self.weight).sum()


CASES = {
    "no_grad_mul_": (ScaledInPlace, "'linear.weight'", lambda: torch.randn(2, 4)),
    "embedding_max_norm": (
        MaxNormEmbedding,
        "'embedding.weight'",
        lambda: torch.tensor([[1, 2, 7], [2, 3, 3]]),
    ),
    "replaced": (Replaced, "'weight'", lambda: torch.randn(2, 4)),
}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_parameter_write_is_refused_by_name(case: str, frontend: str) -> None:
    """Fallback disabled: the export raises, naming the parameter; the user's parameters are
    what they were (the trace wrote into the export's copy)."""
    build, name, make_input = CASES[case]
    torch.manual_seed(0)
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = ORTModule(model, DebugOptions(exporter=frontend))
    with pytest.raises(ExportError, match=f"writes parameter\\(s\\) {name}"):
        wrapped(make_input())
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize("case", list(CASES))
def test_the_default_policy_trains_it_as_eager(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Default fallback policy: one warning naming the write, then PyTorch runs the module;
    losses, gradients and weights over three SGD steps equal eager's exactly."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    build, name, make_input = CASES[case]
    torch.manual_seed(0)
    eager = build()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for step in range(3):
        x = make_input()
        want = eager(x)
        if step == 0:
            with pytest.warns(UserWarning, match=f"writes parameter\\(s\\) {name}"):
                got = wrapped(x)
        else:
            got = wrapped(x)
        assert torch.equal(got, want), step
        for loss, opt in zip((want, got), optimizers, strict=True):
            loss.backward()
            opt.step()
        for (n, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
            assert torch.equal(q, p), (step, n)
            assert q.grad is not None and p.grad is not None
            assert torch.equal(q.grad, p.grad), (step, n)
        for opt in optimizers:
            opt.zero_grad()
