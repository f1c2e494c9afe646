"""ReLU, decided in two halves (its backward first): the engine's ``Relu`` is as fast as
PyTorch's, its ``ReluGrad`` is not, so the forward can stay on the engine while the backward
runs on PyTorch (:data:`ENGINE_FORWARD`, ``passes/engine_forwards.py``). Sized by the traced
input.

>>> from ortmodule_exporter.aten.kernel_choice import measure_relu_backward
>>> engine_us, torch_us = measure_relu_backward(1 << 18)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from ..gradients import GradientNode, register_aten_gradient
from .choice import choose
from .fx_nodes import (
    AtenChoice,
    fx_arg,
    fx_float32,
    fx_needs_grad,
    fx_sizes,
    register_fx_kernel_choice,
)
from .helpers import _all_tensors, _dtype
from .measuring import _engine_us, _randn, _seeded, _torch_us
from .registry import CoveredOperator, _opset9, register_kernel_choice
from .traced import _traced

RELU = "_ortmodule_relu"
RELU_BACKWARD = "_ortmodule_relu_backward"


#: the overload of an ATen node whose forward runs on the engine's kernel and only its backward
#: on PyTorch's (see :data:`ENGINE_FORWARDS`)
ENGINE_FORWARD = "engine_forward"


def _relu(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    (x,) = inputs
    assert x is not None
    return [torch.relu(x)]


def _relu_backward(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    grad, y = inputs
    assert grad is not None and y is not None
    # eager's derivative of relu reads its result
    return [torch.ops.aten.threshold_backward(grad, y, 0)]


register_aten_function(RELU, AtenFunction(_relu, _all_tensors))
register_aten_function(RELU_BACKWARD, AtenFunction(_relu_backward, _all_tensors))
for _overload in ("", ENGINE_FORWARD):
    register_aten_gradient(
        RELU, _overload, [GradientNode.aten(RELU_BACKWARD, ["GO(0)", "O(0)"], ["GI(0)"])]
    )
#: an ATen operator -> the engine's node its ``ENGINE_FORWARD`` overload becomes once the graph
#: is built (``passes/engine_forwards.py``)
ENGINE_FORWARDS: dict[str, str] = {RELU: "Relu"}


def measure_relu(numel: int) -> tuple[float, float]:
    """Microseconds of ReLU forward on ``numel`` float32 elements: (engine, torch). Engine:
    ``Relu``; PyTorch: ``relu`` and one ATen node. The backward is timed on its own
    (:func:`measure_relu_backward`): the engine's ``Relu`` is quick, its ``ReluGrad`` is not."""
    from onnx import helper

    _seeded()
    x = _randn(numel)
    engine_us = _engine_us("relu", [helper.make_node("Relu", ["x"], ["y"])], {"x": x}, ["y"])
    return engine_us, _torch_us(lambda: _relu("", [x]), aten_nodes=1, engine_us=engine_us)


def measure_relu_backward(numel: int) -> tuple[float, float]:
    """Microseconds of ReLU's backward on ``numel`` float32 elements: (engine, torch). Engine:
    ``ReluGrad``; PyTorch: ``threshold_backward`` and one ATen node."""
    from onnx import helper

    nodes = [helper.make_node("ReluGrad", ["dy", "y"], ["dx"], domain="com.microsoft")]
    _seeded()
    y, dy = torch.relu(_randn(numel)), _randn(numel)
    engine_us = _engine_us("relu_backward", nodes, {"dy": dy, "y": y}, ["dx"])
    return engine_us, _torch_us(
        lambda: _relu_backward("", [dy, y]), aten_nodes=1, engine_us=engine_us
    )


def _relu_symbolic(default: Callable[..., Any], g: Any, self: Any) -> Any:
    """ReLU's forward and backward are chosen apart: the engine's ``Relu`` is about as fast as
    PyTorch's, its ``ReluGrad`` several times slower at a CNN's activation sizes. Forward on
    the engine with the backward on PyTorch is an ATen node of overload ``ENGINE_FORWARD``
    (its gradient is PyTorch's) that a built-graph pass turns back into ``Relu``. A forward on
    PyTorch always has its backward there too (no ``ReluGrad`` after an ATen forward)."""
    dtype = _dtype(self)
    traced = _traced(g)
    # without a trace record the gradient's needs are unknown: the engine's kernel stays
    if dtype != "Float" or traced is None or not traced.input_needs_grad:
        return default(g, self)
    sizes = traced.sizes[0] if traced.sizes else None
    numel = math.prod(sizes) if sizes is not None else None
    if choose("relu_backward", dtype, numel, measure_relu_backward) != "torch":
        return default(g, self)
    forward = choose("relu", dtype, numel, measure_relu)
    overload = ENGINE_FORWARD if forward == "engine" else ""
    out = g.op(f"{ATEN_DOMAIN}::ATen", self, operator_s=RELU, overload_name_s=overload, outputs=1)
    out.setType(self.type())
    return out


register_kernel_choice(CoveredOperator("aten::relu", _relu_symbolic, _opset9("relu")))


def _relu_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`_relu_symbolic`, sized by the example inputs."""
    x = fx_arg(node, 0, "self")
    if not fx_float32(x) or not fx_needs_grad(x):
        return None
    sizes = fx_sizes(x)
    numel = math.prod(sizes) if sizes is not None else None
    if choose("relu_backward", "Float", numel, measure_relu_backward) != "torch":
        return None
    forward = choose("relu", "Float", numel, measure_relu)
    return AtenChoice(RELU, ENGINE_FORWARD if forward == "engine" else "", (x,))


register_fx_kernel_choice([torch.ops.aten.relu.default], _relu_fx)
