"""ATen outputs get their traced sizes as fixed dims only where those cannot change
(``passes/aten_nodes._fix_static_sizes``): fixed inputs, the broadcast shape, an operator whose
sizes do not depend on values."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.aten.untrainable import TRACED_TYPES
from ortmodule_exporter.passes.aten_nodes import _declare_traced_types


def _graph(operator: str, input_dims: list[int | str], traced: str) -> onnx.GraphProto:
    node = helper.make_node(
        "ATen", ["x"], ["y"], domain=ATEN_DOMAIN, operator=operator, overload_name=""
    )
    node.attribute.append(helper.make_attribute(TRACED_TYPES, traced))
    return helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        # what the TorchScript exporter writes for an output it cannot infer
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["ATen/y_dim_0"])],
    )


def _dims(graph: onnx.GraphProto) -> list[int | str]:
    (vi,) = [v for v in graph.value_info if v.name == "y"]
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def test_a_fixed_input_fixes_the_output_sizes() -> None:
    graph = _graph("softplus", [1], f"{TensorProto.FLOAT}:1:1")
    _declare_traced_types(graph)
    assert _dims(graph) == [1]
    assert not [a for a in graph.node[0].attribute if a.name == TRACED_TYPES]


@pytest.mark.parametrize(
    ("operator", "input_dims", "traced"),
    [
        ("softplus", ["n"], "1:1:1"),  # a dynamic input: the traced 1 may be any size
        ("unique", [1], "1:1:1"),  # sizes that depend on the values
        # the same, known from PyTorch's dynamic_output_shape tag: x[mask] with every element
        # of the mask true at the trace
        ("index", [3], "1:1:3"),
        ("softplus", [1], "1:1:?"),  # sizes not traced
        ("sum", [3], "1:1:1"),  # not the input's shape
    ],
)
def test_sizes_that_may_change_stay_as_exported(
    operator: str, input_dims: list[int | str], traced: str
) -> None:
    graph = _graph(operator, input_dims, traced)
    _declare_traced_types(graph)
    assert _dims(graph) == ["ATen/y_dim_0"]
