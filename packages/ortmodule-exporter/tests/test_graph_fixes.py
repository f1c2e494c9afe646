"""Graph rewrites for shapes the engine gets wrong: ``passes.engine_graph_fixes`` (sequence
concatenation as Concat, casts to their input's type) and ``passes.scalar_gradients`` (0-d
gradients keep rank 0)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from conftest import assert_engine_matches_eager
from onnx import TensorProto, helper

from ortmodule_exporter.engine_binding import import_onnxruntime
from ortmodule_exporter.passes.engine_graph_fixes import fix_graph
from ortmodule_exporter.passes.scalar_gradients import keep_scalar_gradients


def _sequence_concat(axis: int, new_axis: int) -> onnx.ModelProto:
    names = ["a", "b", "c"]
    graph = helper.make_graph(
        [
            helper.make_node("SequenceConstruct", names, ["seq"]),
            helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=axis, new_axis=new_axis),
        ],
        "stack",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    ort = import_onnxruntime()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize(("axis", "new_axis"), [(0, 0), (1, 0), (-1, 1), (0, 1), (2, 1)])
def test_concat_from_a_constructed_sequence_becomes_concat(axis: int, new_axis: int) -> None:
    model = _sequence_concat(axis, new_axis)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 3)).astype(np.float32) for n in "abc"}
    expected = _run(model, feeds)
    assert fix_graph(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "ConcatFromSequence" not in ops and "SequenceConstruct" not in ops
    np.testing.assert_array_equal(_run(model, feeds), expected)


def _training_graph(constant_readers: list[str]) -> onnx.ModelProto:
    """A forward half, YieldOp, and backward nodes reading a (1,) float constant ``half``."""
    nodes = [
        helper.make_node("Sqrt", ["x"], ["y"]),
        helper.make_node("YieldOp", ["y"], ["y_grad"], domain="com.microsoft"),
    ]
    for i, reader in enumerate(constant_readers):
        if reader == "forward":
            nodes.insert(1, helper.make_node("Mul", ["x", "half"], [f"fwd{i}"]))
        else:
            nodes.append(helper.make_node(reader, ["y_grad", "half"], [f"bwd{i}"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        initializer=[onnx.numpy_helper.from_array(np.array([0.5], dtype=np.float32), "half")],
    )
    return helper.make_model(graph)


def _dims(model: onnx.ModelProto) -> list[int]:
    return list(next(i for i in model.graph.initializer if i.name == "half").dims)


def test_a_backward_constant_of_shape_one_becomes_0_d() -> None:
    model = _training_graph(["Mul", "Div"])
    assert keep_scalar_gradients(model) == 1
    assert _dims(model) == []


@pytest.mark.parametrize(
    "readers", [["forward", "Mul"], ["Reshape"]], ids=["read_by_the_forward", "not_elementwise"]
)
def test_other_constants_keep_their_shape(readers: list[str]) -> None:
    model = _training_graph(readers)
    assert keep_scalar_gradients(model) == 0
    assert _dims(model) == [1]


def test_an_inference_graph_is_left_alone() -> None:
    model = _training_graph(["Mul"])
    del model.graph.node[1:]  # no YieldOp: no backward half
    assert keep_scalar_gradients(model) == 0


def _unit_step(numerator: list[float], folded: bool) -> onnx.ModelProto:
    """x * ((hi - lo) / d) with hi - lo == numerator: Sub of two Constants (folded=False, as
    torch.linspace exports its step) or one Constant."""
    one = np.array(numerator, dtype=np.float32).reshape(() if len(numerator) == 1 else (1, 1))
    if folded:
        nodes = [helper.make_node("Constant", [], ["num"], value=onnx.numpy_helper.from_array(one))]
    else:
        nodes = [
            helper.make_node(
                "Constant", [], ["hi"], value=onnx.numpy_helper.from_array(one + np.float32(0.5))
            ),
            helper.make_node(
                "Constant", [], ["lo"], value=onnx.numpy_helper.from_array(np.float32(0.5))
            ),
            helper.make_node("Sub", ["hi", "lo"], ["num"]),
        ]
    nodes += [
        helper.make_node("Div", ["num", "d"], ["step"]),
        helper.make_node("Mul", ["x", "step"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "unit_step",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("d", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("numerator", "folded"), [([1.0], False), ([1.0], True), ([[1.0]], True)])
def test_a_division_of_one_read_by_a_mul_becomes_a_reciprocal(
    numerator: list[float], folded: bool
) -> None:
    # the engine's DivMulFusion (1 / d * x -> x / d) crashed the process (issue #42)
    model = _unit_step(numerator, folded)
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((2, 3)).astype(np.float32),
        "d": rng.uniform(1, 5, 3).astype(np.float32),
    }
    expected = _run(model, feeds)
    assert fix_graph(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "Div" not in ops and "Reciprocal" in ops
    got = _run(model, feeds)
    assert got.shape == expected.shape
    # the engine's CPU Reciprocal is within an ulp of 1 / d, not always the same float
    np.testing.assert_allclose(got, expected, rtol=3e-7, atol=0)


def test_a_division_of_anything_else_stays() -> None:
    model = _unit_step([2.0], folded=False)
    assert fix_graph(model) == 0
    assert "Div" in [n.op_type for n in model.graph.node]


def test_a_cast_to_the_inferred_type_of_its_input_goes() -> None:
    """Its input (a Reshape's output) has no declared type; ONNX's inference gives it one."""
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Cast", ["r"], ["c"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["c", "c"], ["y"]),
        ],
        "square",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.array([3, 2], dtype=np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert fix_graph(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Reshape", "Mul"]
    assert list(model.graph.node[1].input) == ["r", "r"]


class _SquareOfAFloat(torch.nn.Module):
    """``h.float()`` on a float tensor, then ``h * h``: the engine's optimiser failed dropping
    the Cast ("Argument mismatch when removing edge"; hy_v4's hyper-connection norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).reshape(2, 4, 8).float()
        return h * h


def test_a_no_op_cast_read_twice_by_one_node_trains() -> None:
    torch.manual_seed(0)
    assert_engine_matches_eager(_SquareOfAFloat(), (torch.randn(8, 8, requires_grad=True),))


def _logsumexp(opset: int, **attrs: object) -> onnx.ModelProto:
    inputs = ["x"]
    if opset >= 18 and "axes" in attrs:
        axes = attrs.pop("axes")
        inputs.append("axes")
        nodes = [helper.make_node("Constant", [], ["axes"], value_ints=axes)]
    else:
        nodes = []
    nodes.append(helper.make_node("ReduceLogSumExp", inputs, ["y"], **attrs))
    graph = helper.make_graph(
        nodes,
        "lse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize(
    "attrs", [{"axes": [-1], "keepdims": 0}, {"axes": [0, 2], "keepdims": 0}, {"keepdims": 0}]
)
def test_logsumexp_without_kept_dims_keeps_them_and_squeezes(attrs: dict[str, object]) -> None:
    model = _logsumexp(17, **attrs)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)}
    expected = _run(model, feeds)
    assert fix_graph(model) == 1
    assert [n.op_type for n in model.graph.node][-1] == "Squeeze"
    reduce = next(n for n in model.graph.node if n.op_type == "ReduceLogSumExp")
    assert [a.i for a in reduce.attribute if a.name == "keepdims"] == [1]
    got = _run(model, feeds)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("opset", "attrs"), [(17, {"axes": [1], "keepdims": 1}), (18, {"axes": [1], "keepdims": 0})]
)
def test_other_logsumexps_stay(opset: int, attrs: dict[str, object]) -> None:
    model = _logsumexp(opset, **attrs)
    assert fix_graph(model) == 0


class _SquareOfACast(torch.nn.Module):
    """DeepSeek V4's RMS norm: ``x.float()`` of a float tensor, then ``x * x``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).float()
        return h * (h * h).mean(-1, keepdim=True).rsqrt()


def test_a_cast_to_its_own_type_read_twice_by_one_node_is_dropped() -> None:
    # the export declares no type for the Linear's output, so the Cast stayed, and the engine's
    # RemoveUnnecessaryCasts failed on the Mul reading it twice ("Argument mismatch when
    # removing edge")
    run = assert_engine_matches_eager(_SquareOfACast(), (torch.randn(3, 4, requires_grad=True),))
    assert "Cast" not in [n.op_type for n in run.built.exported.model.graph.node]


class _LayerNormsOfOneTensor(torch.nn.Module):
    """Three layer norms of one tensor, of the input itself or of a value computed from it."""

    def __init__(self, computed: bool) -> None:
        super().__init__()
        self.computed = computed
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.computed:
            x = x * 2.0
        a, b, c = (norm(x) for norm in self.norms)
        return a * b + c


@pytest.mark.parametrize("computed", [False, True], ids=["input", "computed"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_layer_norms_of_one_tensor_train(computed: bool, requires_grad: bool) -> None:
    """The engine named every LayerNormalizationGrad's input gradient ``x_grad`` even where
    ``x`` takes none ("Duplicate definition of name"); its own merge of the centred copies
    ``x - mean(x)`` made them one tensor again."""
    torch.manual_seed(0)
    x = torch.randn(3, 8).requires_grad_(requires_grad)
    assert_engine_matches_eager(_LayerNormsOfOneTensor(computed), (x,))
