"""The grouped 1-D ConvGrad rewrite (passes/grouped_conv_grad.py): the engine's CPU ConvGrad run
as the 2-D kernel gives PyTorch's gradients, and only grouped 1-D ConvGrads are touched.

The rewritten graph runs in a plain session of the engine's kernels (ConvGrad is one of them),
so the arithmetic of the replacement is checked on its own; the parity tests in
``packages/ortmodule/tests/test_silent_mismatch.py`` check it inside training.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest
import torch
from conftest import engine_model

from ortmodule_exporter.passes.grouped_conv_grad import route_grouped_conv_grads

F32 = onnx.TensorProto.FLOAT


def _conv_grad_model(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], y_shape: tuple[int, ...], **attrs: object
) -> onnx.ModelProto:
    node = onnx.helper.make_node(
        "ConvGrad", ["dY", "X", "W"], ["dX", "dW", "dB"], name="g", domain="com.microsoft", **attrs
    )
    graph = onnx.helper.make_graph(
        [node],
        "conv_grad",
        [
            onnx.helper.make_tensor_value_info("dY", F32, list(y_shape)),
            onnx.helper.make_tensor_value_info("X", F32, list(x_shape)),
            onnx.helper.make_tensor_value_info("W", F32, list(w_shape)),
        ],
        [onnx.helper.make_tensor_value_info(n, F32, None) for n in ("dX", "dW", "dB")],
    )
    return engine_model(graph, "com.microsoft")


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(session.run(["dX", "dW", "dB"], feeds))


@pytest.mark.parametrize(
    ("channels", "groups", "kernel", "stride", "padding", "dilation"),
    [(16, 16, 3, 1, 2, 1), (8, 4, 4, 2, 1, 1), (6, 3, 3, 1, 3, 2), (4, 2, 1, 1, 0, 1)],
)
def test_grouped_1d_conv_grad_runs_as_2d_and_equals_pytorch(
    channels: int, groups: int, kernel: int, stride: int, padding: int, dilation: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, channels, 9, generator=gen, requires_grad=True)
    conv = torch.nn.Conv1d(
        channels, channels, kernel, stride, padding, dilation, groups=groups, bias=True
    )
    y = conv(x)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    model = _conv_grad_model(
        tuple(x.shape),
        tuple(conv.weight.shape),
        tuple(y.shape),
        group=groups,
        kernel_shape=[kernel],
        strides=[stride],
        pads=[padding, padding],
        dilations=[dilation],
    )
    assert route_grouped_conv_grads(model, "cpu") == 1
    assert [n.op_type for n in model.graph.node].count("ConvGrad") == 1
    lifted = next(n for n in model.graph.node if n.op_type == "ConvGrad")
    assert [a.ints for a in lifted.attribute if a.name == "kernel_shape"] == [[1, kernel]]
    feeds = {
        "dY": dy.numpy(),
        "X": x.detach().numpy(),
        "W": conv.weight.detach().numpy(),
    }
    d_x, d_w, d_b = _run(model, feeds)
    np.testing.assert_allclose(d_x, x.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_w, conv.weight.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_b, conv.bias.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_ungrouped_2d_and_cuda_conv_grads_are_left_alone() -> None:
    ungrouped = _conv_grad_model((2, 4, 9), (4, 4, 3), (2, 4, 7), group=1, kernel_shape=[3])
    two_d = _conv_grad_model((2, 4, 5, 5), (4, 1, 3, 3), (2, 4, 3, 3), group=4, kernel_shape=[3, 3])
    grouped = _conv_grad_model((2, 4, 9), (4, 1, 3), (2, 4, 7), group=4, kernel_shape=[3])
    assert route_grouped_conv_grads(ungrouped, "cpu") == 0
    assert route_grouped_conv_grads(two_d, "cpu") == 0
    assert route_grouped_conv_grads(grouped, "cuda") == 0
    assert [n.op_type for n in grouped.graph.node] == ["ConvGrad"]


def test_the_rank_is_read_from_the_weight_when_kernel_shape_is_absent() -> None:
    model = _conv_grad_model((2, 4, 9), (4, 1, 3), (2, 4, 7), group=4)
    assert route_grouped_conv_grads(model, "cpu") == 1
    gen = np.random.default_rng(0)
    feeds = {
        "dY": gen.standard_normal((2, 4, 7), dtype=np.float32),
        "X": gen.standard_normal((2, 4, 9), dtype=np.float32),
        "W": gen.standard_normal((4, 1, 3), dtype=np.float32),
    }
    x = torch.from_numpy(feeds["X"]).requires_grad_()
    w = torch.from_numpy(feeds["W"]).requires_grad_()
    torch.nn.functional.conv1d(x, w, groups=4).backward(torch.from_numpy(feeds["dY"]))
    d_x, d_w, _ = _run(model, feeds)
    np.testing.assert_allclose(d_x, x.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_w, w.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_grouped_3d_conv_grad_runs_on_pytorch_unless_it_cannot() -> None:
    shapes = ((2, 4, 3, 5, 5), (4, 1, 3, 3, 3), (2, 4, 3, 5, 5))
    routed = _conv_grad_model(*shapes, group=4, kernel_shape=[3, 3, 3], pads=[1] * 6)
    assert route_grouped_conv_grads(routed, "cpu") == 1
    (node,) = routed.graph.node
    assert (node.domain, node.op_type) == ("org.pytorch.aten", "ATen")
    assert list(node.output) == ["dX", "dW", "dB"]
    params = onnx.numpy_helper.to_array(routed.graph.initializer[0]).tolist()
    assert params == [1, 1, 1, 1, 1, 1, 1, 1, 1, 4]  # strides, padding, dilations, groups
    asymmetric = _conv_grad_model(*shapes, group=4, kernel_shape=[3, 3, 3], pads=[1, 1, 1, 0, 1, 1])
    assert route_grouped_conv_grads(asymmetric, "cpu") == 0
