"""A parameter that reaches the outputs only through integer or bool values (a sparse-attention
indexer whose scores only pick TopK's indices) has no gradient, as in eager; the engine's
builder refused it ("Cannot compute the partial derivative for 'indexer.weight' as it's
unreachable from the output node(s)")."""

from __future__ import annotations

import onnx
import torch
from conftest import assert_engine_matches_eager

from ortmodule_exporter import export
from ortmodule_exporter.onnx_graph import differentiable_inputs


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
