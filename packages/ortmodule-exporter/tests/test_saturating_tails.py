"""The Sigmoid and Tanh pass (passes/saturating_tails.py) and the engine kernel facts it rests on.

The engine's elementwise kernels run here in plain sessions, over float32 inputs from -200 to
200 (log-spaced magnitudes), against PyTorch's on the same inputs: Sigmoid's tail is off (0
where eager's is small) and Tanh's gradient loses more than eager's as it saturates, which is
why the pass exists; the others are within a few float32 roundings of eager's. The parity tests in
``packages/ortmodule/tests/test_operator_routes.py`` check the pass inside training.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import engine_model

from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes.aten_nodes import prepare_aten_nodes
from ortmodule_exporter.passes.saturating_tails import SIGMOID, TANH, saturating_tails_to_pytorch

F32 = onnx.TensorProto.FLOAT
_X = np.concatenate([-np.logspace(-8, 2.3, 2000), [0.0], np.logspace(-8, 2.3, 2000)]).astype(
    np.float32
)


def _model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info(n, F32, [None]) for n in inputs],
        [onnx.helper.make_tensor_value_info(n, F32, [None]) for n in outputs],
    )
    return engine_model(graph, "com.microsoft")


def _engine(op: str, x: np.ndarray, domain: str = "", **attrs: object) -> np.ndarray:
    model = _model([onnx.helper.make_node(op, ["x"], ["y"], domain=domain, **attrs)], ["x"], ["y"])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def _relative_gap(engine: np.ndarray, eager: torch.Tensor) -> float:
    """The largest relative difference where eager's value is a normal float32 (an infinite
    one must be the engine's too)."""
    ours, theirs = torch.from_numpy(engine).double(), eager.double()
    infinite = ~torch.isfinite(theirs)
    assert torch.equal(ours[infinite], theirs[infinite])
    normal = ~infinite & (theirs.abs() > float(np.finfo(np.float32).tiny))
    return float(((ours - theirs).abs() / theirs.abs())[normal].max())


def test_the_engines_sigmoid_is_zero_in_its_tail() -> None:
    # the fact the pass works around (1.19.2, CPU): 116 % off at -17, 0 from -18 on
    x = np.array([-10.0, -17.0, -18.0, -30.0], np.float32)
    got = _engine("Sigmoid", x)
    eager = torch.sigmoid(torch.from_numpy(x))
    assert got[2] == 0.0 and got[3] == 0.0 and bool((eager > 0).all())
    assert _relative_gap(_engine("Sigmoid", _X), torch.sigmoid(torch.from_numpy(_X))) > 1.0


def test_the_engines_tanh_gradient_loses_more_than_eagers_as_it_saturates() -> None:
    # the fact the pass works around: 1 - y*y from the engine's y (4-5 ulps off)
    # against eager's (correctly rounded), x from 4 to 6: median relative error 1.6e-4 to
    # 1.3e-3 against 5.2e-5 to 3.8e-4 (2026-11-29)
    x = np.linspace(4.0, 6.0, 20001).astype(np.float32)
    exact = 1.0 - torch.tanh(torch.from_numpy(x).double()) ** 2
    engine = 1.0 - torch.from_numpy(_engine("Tanh", x)).double() ** 2
    eager = 1.0 - torch.tanh(torch.from_numpy(x)).double() ** 2
    engine_error = float(((engine - exact).abs() / exact).median())
    eager_error = float(((eager - exact).abs() / exact).median())
    assert engine_error > 2.0 * eager_error, (engine_error, eager_error)


_KERNELS: dict[
    str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[torch.Tensor], torch.Tensor]]
] = {
    # the forward alone; its gradient 1 - y*y is the test above
    "Tanh": (lambda x: _engine("Tanh", x), torch.tanh),
    "Exp": (lambda x: _engine("Exp", x), torch.exp),
    "Erf": (lambda x: _engine("Erf", x), torch.erf),
    "Softplus": (lambda x: _engine("Softplus", x), torch.nn.functional.softplus),
    "Log": (lambda x: _engine("Log", np.abs(x) + 1e-30), lambda t: torch.log(t.abs() + 1e-30)),
    "Sqrt": (lambda x: _engine("Sqrt", np.abs(x)), lambda t: torch.sqrt(t.abs())),
    "Sin": (lambda x: _engine("Sin", x), torch.sin),
    "Cos": (lambda x: _engine("Cos", x), torch.cos),
}


@pytest.mark.parametrize("op", sorted(_KERNELS))
def test_the_engines_other_elementwise_kernels_match_eager_to_rounding(op: str) -> None:
    # measured 2026-11-29: at most 2.6e-7 relative (a few float32 roundings) over the range
    engine, eager = _KERNELS[op]
    assert _relative_gap(engine(_X), eager(torch.from_numpy(_X))) < 5e-7


def _kinds(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """Named node -> (op type, ATen operator or "")."""
    return {
        n.name: (n.op_type, str(attribute(n, "operator", ""))) for n in model.graph.node if n.name
    }


def test_every_sigmoid_but_silus_becomes_pytorchs() -> None:
    nodes = [
        onnx.helper.make_node("Sigmoid", ["a"], ["s_gate"], name="gate"),
        onnx.helper.make_node("Mul", ["s_gate", "b"], ["gated"]),
        onnx.helper.make_node("Sigmoid", ["a"], ["s_silu"], name="silu"),
        onnx.helper.make_node("Mul", ["a", "s_silu"], ["silu_out"]),
        onnx.helper.make_node("Sigmoid", ["b"], ["s_twice"], name="twice"),
        onnx.helper.make_node("Mul", ["b", "s_twice"], ["silu_too"]),
        onnx.helper.make_node("Add", ["s_twice", "b"], ["also_read"]),
    ]
    model = _model(nodes, ["a", "b"], ["gated", "silu_out", "silu_too", "also_read"])
    assert saturating_tails_to_pytorch(model) == 2
    kinds = _kinds(model)
    assert kinds["gate"] == ("ATen", SIGMOID)
    # silu's Sigmoid stays: the engine fuses it into QuickGelu
    assert kinds["silu"] == ("Sigmoid", "")
    # one that silu's Mul and another node read is a value of its own: PyTorch's
    assert kinds["twice"] == ("ATen", SIGMOID)
    assert any(o.domain == ATEN_DOMAIN for o in model.opset_import)
    assert saturating_tails_to_pytorch(model) == 0


def _one_constant(name: str) -> list[onnx.NodeProto]:
    # torch_export writes the tanh GELU's 1.0 as a Cast of a double
    return [
        onnx.helper.make_node(
            "Constant", [], [f"{name}_d"], value=onnx.helper.make_tensor("v", 11, [], [1.0])
        ),
        onnx.helper.make_node("Cast", [f"{name}_d"], [name], to=F32),
    ]


def test_every_tanh_but_the_tanh_gelus_becomes_pytorchs() -> None:
    nodes = [
        onnx.helper.make_node("Tanh", ["a"], ["t_cap"], name="cap"),
        onnx.helper.make_node("Mul", ["t_cap", "b"], ["capped"]),
        *_one_constant("one"),
        onnx.helper.make_node("Tanh", ["a"], ["t_gelu"], name="gelu"),
        onnx.helper.make_node("Add", ["one", "t_gelu"], ["gelu_out"]),
        onnx.helper.make_node("Tanh", ["b"], ["t_two"], name="two"),
        onnx.helper.make_node("Add", ["t_two", "b"], ["not_one"]),
    ]
    model = _model(nodes, ["a", "b"], ["capped", "gelu_out", "not_one"])
    assert saturating_tails_to_pytorch(model) == 2
    kinds = _kinds(model)
    assert kinds["cap"] == ("ATen", TANH) and kinds["two"] == ("ATen", TANH)
    # Add(1, Tanh) stays: the engine fuses it into FastGelu
    assert kinds["gelu"] == ("Tanh", "")
    # the moved outputs are declared with their inputs' rank: the engine infers none for ATen
    declared = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in model.graph.value_info}
    assert declared["t_cap"] == 1 and declared["t_two"] == 1


def test_a_tanh_of_an_input_of_unknown_rank_stays_on_the_engine() -> None:
    # Hugging Face xlstm: the engine's gradient of an Unsqueeze below such a tanh needs its rank,
    # which only the engine's own Tanh carries
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Tanh", ["x"], ["t"], name="unknown"),
            onnx.helper.make_node("Sigmoid", ["x"], ["s"], name="gate"),
            onnx.helper.make_node("Mul", ["t", "s"], ["y"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", F32, None)],
        [onnx.helper.make_tensor_value_info("y", F32, None)],
    )
    model = engine_model(graph, "com.microsoft")
    assert saturating_tails_to_pytorch(model) == 1
    kinds = {n.name: n.op_type for n in model.graph.node if n.name}
    assert kinds == {"unknown": "Tanh", "gate": "ATen"}


def test_an_aten_output_of_an_input_of_unknown_rank_is_declared_without_a_rank() -> None:
    # Hugging Face qwen4_exp_text: a sigmoid of a value whose rank ONNX inference does not know
    # was declared 1-d (the meta run's stand-in), and the build failed at the Transpose reading
    # it ("Invalid attribute perm {0, 2, 1}, input shape = {0}")
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node(
                "ATen", ["x"], ["s"], domain=ATEN_DOMAIN, operator=SIGMOID, overload_name=""
            ),
            onnx.helper.make_node("Transpose", ["s"], ["y"], perm=[0, 2, 1]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", F32, None)],
        [onnx.helper.make_tensor_value_info("y", F32, None)],
    )
    model = engine_model(graph, ATEN_DOMAIN)
    prepare_aten_nodes(model, training=True)
    (declared,) = [vi for vi in model.graph.value_info if vi.name == "s"]
    assert declared.type.tensor_type.elem_type == F32
    assert not declared.type.tensor_type.HasField("shape")
