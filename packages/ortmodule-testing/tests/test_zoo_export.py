"""Every ZOO model exports with the TorchScript exporter in training mode, Dropout included."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

import onnx
import pytest
import torch

from ortmodule_testing.zoo import ZOO

CASES = sorted(ZOO)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


def _refill(obj: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, dict):
        return {k: _refill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_refill(v, tensors) for v in obj)
    return obj


class _FlatInputs(torch.nn.Module):
    """Takes the batch's tensors flat, bakes its Python values in, returns the outputs flat."""

    def __init__(self, model: torch.nn.Module, batch: Any) -> None:
        super().__init__()
        self.model = model
        self.batch = batch

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = _refill(self.batch, iter(tensors))
        return tuple(_tensors(self.model(*args, **kwargs)))


def _export(name: str) -> onnx.ModelProto:
    case = ZOO[name]
    batch = case.make_batch(0)
    wrapper = _FlatInputs(case.build(seed=0), batch)
    buffer = io.BytesIO()
    torch.onnx.export(
        wrapper,
        tuple(_tensors(batch)),
        buffer,
        dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING,
        opset_version=17,
        do_constant_folding=False,
    )
    model = onnx.load_from_string(buffer.getvalue())
    onnx.checker.check_model(model)
    return model


# The legacy exporter warns that it is legacy, and the tracer about shapes it records as
# constants; neither matters for a fixed-shape export.
@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::UserWarning", "ignore::torch.jit.TracerWarning"
)
@pytest.mark.parametrize("name", CASES)
def test_exports_in_training_mode(name: str) -> None:
    graph = _export(name).graph
    ops = {node.op_type for node in graph.node}
    has_dropout = any(isinstance(m, torch.nn.Dropout) for m in ZOO[name].build().modules())
    assert ("Dropout" in ops) == has_dropout, sorted(ops)
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            attrs = {a.name: a.i for a in node.attribute}
            assert attrs.get("training_mode") == 1
            # Training-mode BatchNormalization also returns the updated running statistics.
            assert len(node.output) == 3
