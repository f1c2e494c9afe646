"""An output the user does not differentiate gets a zero gradient of the smallest shape the
graph allows (issue #41: GPT-2's unused logits cost a 206 MB zero tensor each backward).

Where the graph reads the output itself (a loss computed from the logits), the engine adds the
gradient autograd hands in to its own with a broadcasting ``Sum``, and a 0-d zero gives the same
result. Elsewhere the gradient is fed at the output's full shape.
"""

from __future__ import annotations

from typing import Any

import onnx
import pytest
import torch
from onnx import helper

from ortmodule import ORTModule
from ortmodule_exporter.aten.kernel_choice import adds_output_grad
from ortmodule_exporter.engine import summed_output_grads
from ortmodule_testing.parity import clone_model


class _LossAndLogits(torch.nn.Module):
    """A causal-LM head: returns the loss and the logits it is computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(ids)))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return loss, logits


class _TwoHeads(torch.nn.Module):
    """Two outputs the graph does not read itself: each gradient feeds the backward directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(x)
        return self.a(h), self.b(h)


def _training_graph(wrapped: ORTModule) -> Any:
    graph = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert graph is not None
    return graph


def _record_backward_feeds(wrapped: ORTModule) -> list[list[tuple[int, ...]]]:
    """Wraps the training session's backward; returns the list each call's feed shapes go to."""
    graph = _training_graph(wrapped)
    seen: list[list[tuple[int, ...]]] = []
    backward = graph.session.backward

    def recording(feeds: list[torch.Tensor], state: Any) -> Any:
        seen.append([tuple(f.shape) for f in feeds])
        return backward(feeds, state)

    graph.session.backward = recording
    return seen


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _adds_in_loss(wrapped: ORTModule) -> bool:
    """Whether PyTorch's loss gradient adds the logits' outside gradient itself, with no
    ``Add`` of the outside gradient left (``passes/output_grad_sums.py``)."""
    nodes = list(_training_graph(wrapped).built.model.graph.node)
    yielded = {name for n in nodes if n.op_type == "YieldOp" for name in n.output}
    adds = [n for n in nodes if n.op_type == "Add" and set(n.input) & yielded]
    folded = [n for n in nodes if adds_output_grad(n)]
    assert bool(adds) != bool(folded), (adds, folded)
    return bool(folded)


@pytest.mark.parametrize("use_logits", [False, True])
@pytest.mark.parametrize("kernels", ["ENGINE", "TORCH"])
def test_unused_logits_take_a_scalar_zero_and_gradients_match_eager(
    use_logits: bool, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the engine's loss gradient the engine's ``Add`` sums the two; on PyTorch's, the loss
    gradient adds the outside one in place (nothing for the 0-d zero)."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", kernels)
    torch.manual_seed(0)
    eager = _LossAndLogits()
    wrapped = ORTModule(clone_model(eager))
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))

    wrapped(ids)[0].backward()  # the first call builds the graph
    wrapped.zero_grad()
    assert _training_graph(wrapped).built.summed_output_grads == frozenset({1})
    assert _adds_in_loss(wrapped) == (kernels == "TORCH")
    seen = _record_backward_feeds(wrapped)

    for model in (eager, wrapped):
        loss, logits = model(ids)
        (loss + logits.square().mean() if use_logits else loss).backward()
    if use_logits:
        assert seen == [[(), (3, 7, 50)]]  # the user's gradient, as autograd hands it in
    else:
        assert seen == [[(), ()]]  # the loss's 1.0 and the logits' 0-d zero
    for got, want in zip(_grads(wrapped), _grads(eager), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_loss_gradient_adds_a_full_or_a_zero_outside_gradient() -> None:
    """``adds_output_grad``: the outside gradient, reshaped as the graph reshapes the loss's
    gradient, added to it; a 0-d zero adds nothing."""
    from ortmodule_exporter.aten.kernel_choice.cross_entropy import (
        ADDS_OUTPUT_GRAD,
        _cross_entropy_backward,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=gen)
    target = torch.tensor([0, 4, 1, -100, 2, 2])
    lse = torch.logsumexp(logits, 1)
    inputs = [torch.tensor(1.0), logits, lse, target, torch.tensor(5.0), torch.tensor([1, -100])]
    (plain,) = _cross_entropy_backward("", list(inputs))
    outside = torch.randn(2, 3, 5, generator=gen)
    shape = torch.tensor([2, 3, 5])
    (full,) = _cross_entropy_backward(ADDS_OUTPUT_GRAD, [*inputs, outside, shape])
    (zero,) = _cross_entropy_backward(ADDS_OUTPUT_GRAD, [*inputs, torch.tensor(0.0), shape])
    assert plain is not None and full is not None and zero is not None
    torch.testing.assert_close(full, plain + outside.reshape(6, 5))
    assert torch.equal(zero, plain)


def test_an_output_the_graph_does_not_read_takes_a_full_shape_zero() -> None:
    torch.manual_seed(0)
    eager = _TwoHeads()
    wrapped = ORTModule(clone_model(eager))
    x = torch.randn(5, 8)
    wrapped(x)[0].sum().backward()
    wrapped.zero_grad()
    assert _training_graph(wrapped).built.summed_output_grads == frozenset()
    seen = _record_backward_feeds(wrapped)
    for model in (eager, wrapped):
        model(x)[0].sum().backward()
    assert seen == [[(5, 6), (5, 4)]]
    for got, want in zip(_grads(wrapped), _grads(eager), strict=True):
        torch.testing.assert_close(got, want)


def test_a_gradient_read_by_anything_but_a_sum_keeps_the_full_shape() -> None:
    """The check of the final graph: a gradient the YieldOp does not list as full-shape, but
    read by another operator (a built-graph pass could put one there), is fed in full."""
    y = helper.make_tensor_value_info
    f = onnx.TensorProto.FLOAT
    yield_op = helper.make_node(
        "YieldOp", ["out0", "out1"], ["out0_grad", "out1_grad"], domain="com.microsoft"
    )
    yield_op.attribute.append(
        helper.make_attribute("full_shape_outputs", [], attr_type=onnx.AttributeProto.INTS)
    )
    nodes = [
        yield_op,
        helper.make_node("Sum", ["out0_grad", "inner_grad"], ["s0"]),
        helper.make_node("Mul", ["out1_grad", "inner_grad"], ["s1"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [y("out0", f, [2]), y("out1", f, [2]), y("inner_grad", f, [2])],
        [y("s0", f, [2]), y("s1", f, [2])],
    )
    assert summed_output_grads(helper.make_model(graph)) == frozenset({0})
