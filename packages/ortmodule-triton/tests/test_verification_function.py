"""The verification route's Function in eager autograd: forward and backward kernels of fused
subgraphs against torch on the same math (every input's gradient, broadcast inputs included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import model
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from ortmodule_triton.fusion_config import FusionConfig
from ortmodule_triton.partition import find_subgraphs
from ortmodule_triton.verification import SubgraphRunner, TritonSubgraphFunction


def scalar(name: str, value: float) -> object:
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


def run_both(m, torch_fn, shapes, fixed=(), seed=0):
    """``fixed``: tensors fed after the differentiable ones (the subgraph's other inputs)."""
    (sub,) = find_subgraphs(m, FusionConfig.default())
    runner = SubgraphRunner(sub)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen, requires_grad=True) for s in shapes]
    ys = [x.detach().clone().requires_grad_(True) for x in xs]
    got = TritonSubgraphFunction.apply(runner, *xs, *fixed)
    want = torch_fn(*ys)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    dy = torch.randn(want.shape, generator=gen)
    got.backward(dy)
    want.backward(dy)
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-5)


def test_bias_gelu_chain_gradients():
    # Linear's bias Add then torch's erf GELU: the bias gradient sums over the broadcast rows
    m = model(
        [
            h.make_node("Add", ["x", "b"], ["s"]),
            h.make_node("Div", ["s", "sqrt2"], ["d"]),
            h.make_node("Erf", ["d"], ["e"]),
            h.make_node("Add", ["e", "one"], ["p"]),
            h.make_node("Mul", ["s", "p"], ["q"]),
            h.make_node("Mul", ["q", "half"], ["y"]),
        ],
        [("x", T.FLOAT, ["a", 6]), ("b", T.FLOAT, [6])],
        [("y", T.FLOAT, ["a", 6])],
        [scalar("sqrt2", 2**0.5), scalar("one", 1.0), scalar("half", 0.5)],
    )
    run_both(m, lambda x, b: torch.nn.functional.gelu(x + b), [(4, 6), (6,)])


def test_residual_layer_norm_gradients():
    m = model(
        [
            h.make_node("Add", ["x", "r"], ["s"]),
            h.make_node("LayerNormalization", ["s", "w", "b"], ["y"], axis=-1, epsilon=1e-5),
        ],
        [
            ("x", T.FLOAT, ["a", 3, 8]),
            ("r", T.FLOAT, ["a", 3, 8]),
            ("w", T.FLOAT, [8]),
            ("b", T.FLOAT, [8]),
        ],
        [("y", T.FLOAT, ["a", 3, 8])],
    )
    run_both(
        m,
        lambda x, r, w, b: torch.nn.functional.layer_norm(x + r, (8,), w, b, 1e-5),
        [(2, 3, 8), (2, 3, 8), (8,), (8,)],
    )


def test_masked_scaled_softmax_gradients():
    # attention scores: scale, causal mask by Where, Softmax
    mask = np.tril(np.ones((5, 5), dtype=bool))
    m = model(
        [
            h.make_node("Mul", ["x", "scale"], ["s"]),
            h.make_node("Where", ["mask", "s", "neg"], ["w"]),
            h.make_node("Softmax", ["w"], ["y"], axis=-1),
        ],
        [("x", T.FLOAT, ["b", "h", 5, 5])],
        [("y", T.FLOAT, ["b", "h", 5, 5])],
        [scalar("scale", 0.5), scalar("neg", -1e9), numpy_helper.from_array(mask, "mask")],
    )
    causal = torch.from_numpy(mask)
    run_both(
        m,
        lambda x: torch.softmax(torch.where(causal, x * 0.5, torch.tensor(-1e9)), -1),
        [(2, 3, 5, 5)],
        fixed=[causal],  # a non-scalar initializer stays an input of the fused subgraph
    )


@pytest.mark.parametrize("op", ["Tanh", "Sigmoid", "Relu", "Exp", "Sqrt"])
def test_unary_gradients(op):
    fns = {
        "Tanh": torch.tanh,
        "Sigmoid": torch.sigmoid,
        "Relu": torch.relu,
        "Exp": torch.exp,
        "Sqrt": torch.sqrt,
    }
    m = model(
        [h.make_node("Mul", ["x", "x"], ["s"]), h.make_node(op, ["s"], ["y"])],
        [("x", T.FLOAT, ["a", "b"])],
        [("y", T.FLOAT, ["a", "b"])],
    )
    run_both(m, lambda x: fns[op](x * x), [(3, 7)])
