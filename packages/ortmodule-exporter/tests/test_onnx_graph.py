"""Graph queries of ``onnx_graph`` on small hand-written graphs."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ortmodule_exporter import onnx_graph


def _model() -> onnx.ModelProto:
    # a -> x -> (y, z) -> w (a diamond), b -> z, c unused; k a constant
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Relu", ["a"], ["x"]),
        helper.make_node("Neg", ["x"], ["y"]),
        helper.make_node("Add", ["x", "b"], ["z"]),
        helper.make_node("Mul", ["y", "z"], ["w"]),
        helper.make_node("Constant", [], ["k"], value_float=1.0),
        helper.make_node("Add", ["k", "k"], ["kk"]),
    ]
    inputs = [helper.make_tensor_value_info(n, f, [2]) for n in ("a", "b", "c")]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("w", "kk")]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs))


def test_output_dependencies_name_the_inputs_each_value_is_computed_from() -> None:
    model = _model()
    names = ["w", "kk", "y", "z", "a", "c", "x", "missing", "w"]
    assert onnx_graph.output_dependencies(model, names) == [
        frozenset({"a", "b"}),
        frozenset(),
        frozenset({"a"}),
        frozenset({"a", "b"}),
        frozenset({"a"}),
        frozenset({"c"}),
        frozenset({"a"}),
        frozenset(),
        frozenset({"a", "b"}),
    ]


def test_output_dependencies_of_a_deep_chain() -> None:
    # one walk for all outputs, without recursion: a chain deeper than Python's stack
    f = TensorProto.FLOAT
    depth = 5000
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(depth)]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("v0", f, [1])],
        [helper.make_tensor_value_info(f"v{depth}", f, [1])],
    )
    model = helper.make_model(graph)
    found = onnx_graph.output_dependencies(model, [f"v{depth}", f"v{depth // 2}"])
    assert found == [frozenset({"v0"}), frozenset({"v0"})]
