"""Higher-order gradients through an ORTModule: a clear error, never a silent wrong gradient.

The engine's backward hands PyTorch plain tensors; with ``create_graph=True`` they used to come
back without a graph, so a gradient penalty failed with "element 0 of tensors does not require
grad", or, added to a loss that has a gradient, contributed nothing without a word (issue #36).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ortmodule import ORTModule


@pytest.fixture(autouse=True)
def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def _model() -> ORTModule:
    torch.manual_seed(0)
    return ORTModule(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)))


def test_gradient_penalty_is_refused_with_a_clear_error() -> None:
    model = _model()
    loss = model(torch.randn(4, 6)).sum()
    with pytest.raises(RuntimeError, match="higher-order gradients .*create_graph=True"):
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()


def test_backward_with_create_graph_is_refused() -> None:
    # the silent case: loss + penalty would have trained without the penalty's gradient
    model = _model()
    loss = model(torch.randn(4, 6)).sum()
    with pytest.raises(RuntimeError, match="model.module"):
        loss.backward(create_graph=True)
    assert all(p.grad is None for p in model.parameters())


def test_first_order_autograd_grad_still_runs_the_engine() -> None:
    model = _model()
    x = torch.randn(4, 6)
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    want = torch.autograd.grad(model.module(x).sum(), list(model.module.parameters()))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert model._runner.exports == 1


def test_the_penalty_in_eager_beside_the_engine_trains_as_eager() -> None:
    # what the error suggests: the penalty through model.module, the loss through the engine
    x = torch.randn(4, 6)

    def step(forward: nn.Module, eager: nn.Module) -> list[torch.Tensor]:
        params = list(eager.parameters())
        loss = forward(x).sum()
        grads = torch.autograd.grad(eager(x).sum(), params, create_graph=True)
        (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
        return [p.grad.clone() for p in params]

    model = _model()
    got = step(model, model.module)
    plain = _model().module
    want = step(plain, plain)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
