"""The row moves of padding elimination: what they compute, that each is the other's gradient,
and the shapes symbolic inference gives them (it would otherwise guess the input's rank)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.aten.token_rows import PUT_ROWS, TAKE_ROWS, put_rows, take_rows
from ortmodule_exporter.passes.density import infer_symbolic_shapes
from ortmodule_exporter.sparsity import token_region


def _indices(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = keep.reshape(-1)
    rows = flat.nonzero().squeeze(1)
    inverse = torch.where(flat, flat.long().cumsum(0) - 1, rows.numel()).view(keep.shape)
    return rows, inverse


def test_take_then_put_keeps_the_kept_rows_and_zeros_the_rest() -> None:
    torch.manual_seed(0)
    keep = torch.rand(3, 5) < 0.6
    rows, inverse = _indices(keep)
    x = torch.randn(3, 5, 4, 2)
    taken = take_rows(x, rows)
    assert taken.shape == (int(keep.sum()), 4, 2)
    torch.testing.assert_close(taken, x[keep])
    back = put_rows(taken, inverse)
    torch.testing.assert_close(back, x * keep[..., None, None])
    torch.testing.assert_close(take_rows(back, rows), taken)


def test_each_move_is_the_others_gradient() -> None:
    """<put(y), x> == <y, take(x)>: the gradient of one is the other, which is what the
    registered gradient definitions say."""
    torch.manual_seed(1)
    keep = torch.rand(4, 6) < 0.5
    rows, inverse = _indices(keep)
    x = torch.randn(4, 6, 3, requires_grad=True)
    y = torch.randn(int(keep.sum()), 3, requires_grad=True)
    (take_rows(x, rows) * y.detach()).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, put_rows(y.detach(), inverse))
    (put_rows(y, inverse) * x.detach()).sum().backward()
    assert y.grad is not None
    torch.testing.assert_close(y.grad, take_rows(x.detach(), rows))


def test_symbolic_inference_knows_their_shapes() -> None:
    graph = helper.make_graph(
        [
            helper.make_node(
                "ATen", ["x", "rows", "inverse"], ["taken"], domain=ATEN_DOMAIN, operator=TAKE_ROWS
            ),
            helper.make_node("Relu", ["taken"], ["relu"]),
            helper.make_node(
                "ATen", ["relu", "rows", "inverse"], ["back"], domain=ATEN_DOMAIN, operator=PUT_ROWS
            ),
        ],
        "rows",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8]),
            helper.make_tensor_value_info("rows", TensorProto.INT64, ["kept"]),
            helper.make_tensor_value_info("inverse", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("back", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ATEN_DOMAIN, 1)]
    )
    inferred = infer_symbolic_shapes(model)
    dims = {
        vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in (*inferred.graph.value_info, *inferred.graph.output)
    }
    assert dims["taken"] == ["kept", 8]
    assert dims["relu"] == ["kept", 8]
    assert dims["back"] == ["batch", "seq", 8]
    assert onnx.checker.check_model(inferred) is None


def test_only_products_with_a_weight_count_as_token_wise() -> None:
    """``scores @ values`` (both (batch, seq, ...)) mixes tokens; ``x @ weight`` does not."""
    grid = (2, 5)
    values = {
        "x": np.zeros((2, 5, 4), np.float32),
        "scores": np.zeros((2, 5, 5), np.float32),
        "w": np.zeros((4, 3), np.float32),
        "xw": np.zeros((2, 5, 3), np.float32),
        "mixed": np.zeros((2, 5, 4), np.float32),
    }
    by_weight = helper.make_node("MatMul", ["x", "w"], ["xw"])
    over_tokens = helper.make_node("MatMul", ["scores", "x"], ["mixed"])
    assert token_region.token_wise(by_weight, values, {}, grid)
    assert not token_region.token_wise(over_tokens, values, {}, grid)


def test_labelled_rows_evaluates_the_layers_near_the_loss_only() -> None:
    """The cone from the loss's logits back to the first node that mixes tokens: the attention
    product's output is read (it enters the head), its inputs are not."""
    nodes = [
        helper.make_node("MatMul", ["scores", "x"], ["mixed"]),
        helper.make_node("Transpose", ["w"], ["wt"]),
        helper.make_node("MatMul", ["mixed", "wt"], ["hidden"]),
        helper.make_node("Relu", ["hidden"], ["act"]),
        helper.make_node("MatMul", ["act", "head"], ["logits"]),
        helper.make_node("Reshape", ["logits", "flat"], ["flat_logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["flat_logits", "labels"], ["loss"]),
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", f32, [2, 5, 4]),
            helper.make_tensor_value_info("scores", f32, [2, 5, 5]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [10]),
        ],
        [helper.make_tensor_value_info("loss", f32, [])],
        [
            onnx.numpy_helper.from_array(np.zeros((4, 4), np.float32), "w"),
            onnx.numpy_helper.from_array(np.zeros((4, 3), np.float32), "head"),
            onnx.numpy_helper.from_array(np.array([-1, 3], np.int64), "flat"),
        ],
    )
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    cone = set(token_region.loss_cone(graph, producer, consumers, {"x", "scores", "labels"}))
    assert {"logits", "act", "hidden", "mixed", "flat_logits", "labels", "loss"} <= cone
    assert not {"scores", "x"} & cone
