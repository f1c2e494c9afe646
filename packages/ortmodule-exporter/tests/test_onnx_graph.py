"""Graph queries of ``onnx_graph`` on small hand-written graphs."""

from __future__ import annotations

import numpy as np
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


def test_name_outputs_renames_once_and_copies_inputs_and_repeats() -> None:
    """Outputs w (a node's), a (a graph input), w again and kk: w and kk are renamed wherever
    they appear, the input and the repeated w get an Identity; the graph still
    computes the same values under the new names (the engine runs it)."""
    import numpy as np
    import onnxruntime

    model = _model()
    f = TensorProto.FLOAT
    del model.graph.output[:]
    model.graph.output.extend(
        helper.make_tensor_value_info(n, f, None) for n in ("w", "a", "w", "kk")
    )
    model.ir_version = 8  # what the engine (1.19.2) loads
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 17))
    onnx_graph.name_outputs(model.graph, ["out.0", "out.1", "out.2", "out.3"])
    assert [o.name for o in model.graph.output] == ["out.0", "out.1", "out.2", "out.3"]
    produced = {o: n for n in model.graph.node for o in n.output}
    assert produced["out.0"].op_type == "Mul" and produced["out.3"].op_type == "Add"
    assert [(n.input[0], n.output[0]) for n in model.graph.node if n.op_type == "Identity"] == [
        ("a", "out.1"),
        ("out.0", "out.2"),
    ]
    assert "w" not in produced and "kk" not in produced
    session = onnxruntime.InferenceSession(model.SerializeToString())
    a, b, c = (np.array([1.0, -2.0], np.float32) * k for k in (1, 2, 3))
    w, a_out, w_again, kk = session.run(None, {"a": a, "b": b, "c": c})
    x = np.maximum(a, 0)
    assert np.array_equal(w, -x * (x + b)) and np.array_equal(w_again, w)
    assert np.array_equal(a_out, a) and kk == 2.0


def test_unnamed_nodes_get_unique_names() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"], name="Relu_unnamed1"),
        helper.make_node("Relu", ["b"], ["c"]),
        helper.make_node("Neg", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    assert onnx_graph.name_unnamed_nodes(graph) == 3
    names = [n.name for n in graph.node]
    assert all(names) and len(set(names)) == 4 and names[1] == "Relu_unnamed1"
    assert onnx_graph.name_unnamed_nodes(graph) == 0


def test_constant_values_reads_numeric_constants_with_onnx_types_and_skips_strings() -> None:
    nodes = [
        helper.make_node("Constant", [], ["f"], value_float=0.5),
        helper.make_node("Constant", [], ["i"], value_ints=[1, 2]),
        helper.make_node(
            "Constant", [], ["t"], value=helper.make_tensor("t", TensorProto.INT32, [], [3])
        ),
        # an ATen node's string argument (div's rounding_mode) as the TorchScript exporter
        # writes it: a string attribute named value
        helper.make_node("Constant", [], ["s"], value="floor"),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    assert graph.node[3].attribute[0].type == onnx.AttributeProto.STRING
    values = onnx_graph.constant_values(graph)
    assert set(values) == {"f", "i", "t"}
    assert values["f"].dtype == np.float32 and float(values["f"]) == 0.5
    assert values["i"].dtype == np.int64 and values["i"].tolist() == [1, 2]
    assert values["t"].dtype == np.int32 and int(values["t"]) == 3
