"""Tensor-creation operators whose sizes or bounds come from traced shapes (issue #42).

``torch.linspace(0.5, 1.5, y.shape[-1])`` killed the process while the engine built the gradient
graph: torch's export of the step ``(end - start) / (steps - 1)`` is ``1 / (steps - 1)``, and the
engine's ``DivMulFusion`` rewrite of ``1 / d * x`` crashed (``passes/engine_graph_fixes.py``
rewrites that Div; ``symbolics/creation.py`` exports linspace now). Each case
here trains with fallback disabled (conftest) in the engine and matches eager on the output and
on every parameter gradient (fp32: rtol 1e-4, atol 1e-5). The sizes are traced: the input's
width is the operator's size.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ortmodule import ORTModule

RTOL, ATOL = 1e-4, 1e-5
WIDTH = 12

Make = Callable[[torch.Tensor], torch.Tensor]


def _tril_pairs(y: torch.Tensor) -> torch.Tensor:
    i, j = torch.tril_indices(y.shape[-1], y.shape[-1], offset=-1)
    return y[:, i] * y[:, j]


def _triu_pairs(y: torch.Tensor) -> torch.Tensor:
    i, j = torch.triu_indices(y.shape[-1], y.shape[-1], offset=1)
    return y[:, i] * y[:, j]


def _unit_step_schedule(y: torch.Tensor) -> torch.Tensor:
    # a schedule written out by hand: start + i * (end - start) / (n - 1) with end - start == 1;
    # this one still crashes the engine's build without passes/engine_graph_fixes.py's rewrite
    n = y.shape[-1]
    step = (torch.tensor(1.5) - torch.tensor(0.5)) / (n - 1)
    return y * (torch.arange(n).to(torch.float32) * step + 0.5)


#: name -> y (batch, WIDTH) -> a tensor built from y and a creation op sized by y's shape
CASES: dict[str, Make] = {
    # end - start == 1: the step is 1 / (steps - 1), the graph that crashed the engine
    "linspace_unit_span": lambda y: y * torch.linspace(0.5, 1.5, y.shape[-1]),
    "linspace_negative_unit_span": lambda y: y * torch.linspace(-1.0, 0.0, y.shape[-1]),
    "linspace_added": lambda y: y + torch.linspace(0.0, 1.0, y.shape[-1]),
    # steps from the batch dim, which the engine cannot know before the run
    "linspace_dynamic_steps": lambda y: y * torch.linspace(0.0, 1.0, y.shape[0])[:, None],
    "linspace_float64": lambda y: y * torch.linspace(0.0, 1.0, y.shape[-1], dtype=torch.float64),
    "linspace": lambda y: y * torch.linspace(-2.0, 3.0, y.shape[-1]),
    "linspace_one_step": lambda y: y * torch.linspace(0.5, 1.5, y.shape[0] - 1),
    "linspace_int64": lambda y: y * torch.linspace(0, 30, y.shape[-1], dtype=torch.int64),
    "linspace_of_two_sizes": lambda y: y * torch.linspace(0.0, y.shape[0], y.shape[-1]),
    "logspace_unit_span": lambda y: y * torch.logspace(0.0, 1.0, y.shape[-1]),
    "logspace_base2": lambda y: y * torch.logspace(-1.0, 1.0, y.shape[-1], base=2.0),
    "arange_unit_step_schedule": _unit_step_schedule,
    "arange_float_step": lambda y: y * torch.arange(0.0, y.shape[-1] * 0.25, 0.25),
    "arange_float_start": lambda y: y * torch.arange(0.5, y.shape[-1]),
    "arange_int": lambda y: y * torch.arange(y.shape[-1]),
    "full": lambda y: y * torch.full((y.shape[-1],), 0.3),
    "full_like": lambda y: y * torch.full_like(y, 1.5),
    "ones": lambda y: y * (torch.ones(y.shape[-1]) + 1),
    "zeros": lambda y: y + torch.zeros(y.shape[0], y.shape[-1]),
    "empty": lambda y: y * torch.empty(y.shape[-1]).fill_(0.5),
    "ones_like": lambda y: y * (torch.ones_like(y) * 3),
    "zeros_like": lambda y: y * (torch.zeros_like(y) + 2),
    "empty_like": lambda y: y * torch.empty_like(y).fill_(-0.5),
    "new_ones": lambda y: y * (y.new_ones(y.shape[-1]) * 2),
    "new_zeros": lambda y: y * (y.new_zeros(y.shape) + 0.25),
    "new_full": lambda y: y * y.new_full((y.shape[-1],), 0.75),
    "new_empty": lambda y: y * y.new_empty(y.shape[-1]).fill_(2.0),
    "eye": lambda y: y @ (torch.eye(y.shape[-1]) * 2 + 1),
    "eye_rectangular": lambda y: y @ torch.eye(y.shape[-1], y.shape[0] + 3),
    "tril_indices": _tril_pairs,
    "triu_indices": _triu_pairs,
}


class Model(torch.nn.Module):
    def __init__(self, make: Make) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.make = make

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.make(self.linear(x))


def _train_both(make: Make, batch: int = 2) -> tuple[torch.nn.Module, torch.Tensor, ORTModule]:
    torch.manual_seed(0)
    eager = Model(make)
    ort = ORTModule(Model(make))
    ort.load_state_dict(eager.state_dict())
    x = torch.randn(batch, WIDTH)
    expected, got = eager(x), ort(x)
    torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    for (name, p), (_, q) in zip(eager.named_parameters(), ort.named_parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)
    return eager, x, ort


def _graph_ops(model: ORTModule) -> list[str]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None, "the engine built no training graph"
    return [n.op_type for n in graph.built.exported.model.graph.node]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_creation_op_with_traced_sizes_trains_like_eager(name: str) -> None:
    _eager, _x, ort = _train_both(CASES[name])
    # the engine ran the creation op: no operator of the forward was handed to PyTorch
    ops = _graph_ops(ort)
    assert "ATen" not in ops and "PythonOp" not in ops, ops


def test_the_issue_example_trains_and_a_second_batch_size_reuses_the_fix() -> None:
    # issue #42 verbatim (a scalar loss), then another batch size: the fixed graph re-exports
    # for new shapes and stays equal to eager
    def loss(y: torch.Tensor) -> torch.Tensor:
        return (y * torch.linspace(0.5, 1.5, y.shape[-1])).sum()

    _train_both(loss)
    _train_both(loss, batch=5)


@pytest.mark.parametrize("op", ["randn", "rand"])
def test_random_creation_with_traced_sizes_trains(op: str) -> None:
    # The engine draws from its own generator, so the numbers differ from eager's under the
    # same seed (docs/operators.md). What holds: the graph trains in the engine, the shape is
    # the traced one, and the gradients are those of the numbers the engine drew: for
    # out = (x @ W.T + b) * r, d sum(out) / d b = batch * r.
    draw = getattr(torch, op)

    def make(y: torch.Tensor) -> torch.Tensor:
        return y * draw(y.shape[-1])

    torch.manual_seed(0)
    model = Model(make)
    ort = ORTModule(Model(make))
    ort.load_state_dict(model.state_dict())
    x = torch.randn(3, WIDTH)
    out = ort(x)
    assert out.shape == (3, WIDTH)
    out.sum().backward()
    assert ort.linear.bias.grad is not None
    r = ort.linear.bias.grad / 3
    assert torch.isfinite(r).all() and r.std() > 0
    if op == "rand":
        assert ((r >= 0) & (r < 1)).all()
    with torch.no_grad():
        torch.testing.assert_close(out, model.linear(x) * r, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ort.linear.weight.grad, r[:, None] * x.sum(0), rtol=RTOL, atol=ATOL)


# -- an engine crash is an error, never a dead process (forked.py) -------------------------------


def _crashing_build(monkeypatch: pytest.MonkeyPatch) -> Make:
    """A graph the engine's build segfaults on (1 / d * x, the Reciprocal rewrite off)."""
    from ortmodule_exporter.passes import engine_graph_fixes

    monkeypatch.setattr(engine_graph_fixes, "_unit_reciprocals", lambda model: 0)
    return _unit_step_schedule


def test_an_engine_crash_in_the_build_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ortmodule import EngineBuildError

    make = _crashing_build(monkeypatch)
    with pytest.raises(EngineBuildError, match="SIGSEGV"):
        ORTModule(Model(make))(torch.randn(2, WIDTH))


def test_an_engine_crash_in_the_build_falls_back_to_pytorch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make = _crashing_build(monkeypatch)
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default policy
    torch.manual_seed(0)
    eager = Model(make)
    ort = ORTModule(Model(make))
    ort.load_state_dict(eager.state_dict())
    x = torch.randn(2, WIDTH)
    with pytest.warns(UserWarning, match="SIGSEGV"):
        got = ort(x)
    torch.testing.assert_close(got, eager(x).detach(), rtol=RTOL, atol=ATOL)
