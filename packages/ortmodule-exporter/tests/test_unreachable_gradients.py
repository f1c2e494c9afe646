"""A parameter that reaches the outputs only through integer or bool values (a sparse-attention
indexer whose scores only pick TopK's indices) has no gradient, as in eager; the engine's
builder refused it ("Cannot compute the partial derivative for 'indexer.weight' as it's
unreachable from the output node(s)")."""

from __future__ import annotations

import onnx
import pytest
import torch
from conftest import assert_engine_matches_eager

from ortmodule_exporter import export
from ortmodule_exporter.aten import executor as aten_executor
from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.onnx_graph import attribute, differentiable_inputs


@pytest.fixture(autouse=True)
def _aten() -> None:
    # the TopK route runs in the engine's ATen executor (alone, no other test installed it)
    aten_executor.install()


class _Indexed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.indexer = torch.nn.Linear(6, 5)
        self.scores = torch.nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk = self.indexer(x).topk(2, dim=-1).indices
        keep = torch.zeros_like(topk[..., :1]).expand(*topk.shape[:-1], 5).clone()
        keep = keep.scatter(-1, topk, 1) > 0
        return self.scores(x).masked_fill(~keep, -1e4).softmax(-1)


def test_a_weight_that_only_picks_indices_gets_no_gradient() -> None:
    torch.manual_seed(0)
    run = assert_engine_matches_eager(_Indexed(), (torch.randn(2, 4, 6, requires_grad=True),))
    assert "indexer.weight" not in run.grads and "indexer.bias" not in run.grads
    assert {"scores.weight", "scores.bias", "input.x"} <= set(run.grads)


def test_differentiable_inputs_follow_float_values_only() -> None:
    exported = export(_Indexed(), (torch.randn(2, 4, 6),), training=True)
    names = ["indexer.weight", "indexer.bias", "scores.weight", "scores.bias", "input.x"]
    assert differentiable_inputs(exported.model, names) == {
        "scores.weight", "scores.bias", "input.x"
    }  # fmt: skip
    # a graph output of integer type carries no gradient either
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.INT64)],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2])],
    )
    assert differentiable_inputs(onnx.helper.make_model(graph), ["x"]) == set()


def test_differentiable_inputs_stop_at_engine_stop_gradient_edges() -> None:
    """The stop-gradient copies (a BatchNormalization's running-mean input, an ATen node's
    registered stop edges) carry no gradient: a weight reached only through one has none."""
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    graph = h.make_graph(
        [
            h.make_node(
                "BatchNormalization",
                ["zeros", "ones", "zeros1", "w", "ones"],
                ["y", "copy", "var"],
                training_mode=1,
                momentum=1.0,
            ),
            h.make_node("Mul", ["copy", "x"], ["out"]),
            h.make_node("ATen", ["v"], ["v_copy"], domain=ATEN_DOMAIN, operator="cut"),
            h.make_node("Add", ["out", "v_copy"], ["out2"]),
        ],
        "g",
        [h.make_tensor_value_info(n, f, [2]) for n in ("zeros", "ones", "zeros1", "w", "x", "v")],
        [h.make_tensor_value_info("out2", f, [2])],
    )
    model = h.make_model(graph)
    assert differentiable_inputs(model, ["w", "x", "v"]) == {"x", "v"}
    cut = {"cut"}
    assert differentiable_inputs(
        model, ["w", "x", "v"], lambda n: {0} if attribute(n, "operator") in cut else set()
    ) == {"x"}  # fmt: skip
