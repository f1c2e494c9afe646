"""The memory-efficient gradient pass: parameters become PythonOps fed by one trigger input."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ortmodule_exporter import export
from ortmodule_exporter.components import StepContext
from ortmodule_memory.grad_management import (
    FUNC_NAME,
    GRAD_MGMT,
    TRIGGER,
    ParamSource,
    pull_parameters,
)


@pytest.fixture
def model() -> Iterator[torch.nn.Module]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    m[2].bias.requires_grad_(False)
    ParamSource().pre_forward(StepContext(m, {}))
    yield m
    ParamSource._local.module = None


def test_trainable_parameters_move_behind_the_trigger(model: torch.nn.Module) -> None:
    exported = export(model, (torch.randn(3, 4),), training=True)
    before = set(exported.param_names)
    pull_parameters(exported, {GRAD_MGMT: True})
    graph = exported.model.graph
    pulled = {n.output[1] for n in graph.node if n.op_type == "PythonOp" and _func(n) == FUNC_NAME}
    trainable = {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight"}
    assert pulled == trainable
    inputs = [vi.name for vi in graph.input]
    assert TRIGGER in inputs and not trainable & set(inputs)
    # the frozen bias and the BatchNorm buffers stay parameters of the graph
    assert set(exported.param_names) == before - trainable
    assert {"2.bias", "1.running_mean"} <= set(exported.param_names)
    assert exported.extra_inputs[TRIGGER].requires_grad
    # the first nodes produce the parameters, before anything reads them
    assert all(n.name.endswith("/pull") for n in list(graph.node)[: len(trainable)])


def test_off_by_default_and_for_inference(model: torch.nn.Module) -> None:
    exported = export(model, (torch.randn(3, 4),), training=True)
    pull_parameters(exported, {})
    model.eval()
    inference = export(model, (torch.randn(3, 4),), training=False)
    pull_parameters(inference, {GRAD_MGMT: True})
    for e in (exported, inference):
        assert TRIGGER not in [vi.name for vi in e.model.graph.input] and not e.extra_inputs


def _func(node: object) -> str:
    for a in node.attribute:  # type: ignore[attr-defined]
        if a.name == "func_name":
            return a.s.decode()  # type: ignore[no-any-return]
    return ""
