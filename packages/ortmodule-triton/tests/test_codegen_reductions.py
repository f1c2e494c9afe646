"""Row-template kernels (reductions, Softmax, LayerNormalization) against the reference evaluator;
their gradient ops (com.microsoft, which the reference evaluator lacks) against torch autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, TORCH_TYPES, check_against_reference, model
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from ortmodule_triton import TritonCodegenError, compile_subgraph

MS = "com.microsoft"


def axes(name: str, values: list[int]) -> object:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("reduced", [[-1], [1, 2]])
def test_reduce_sum_mean_max(keepdims, reduced):
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    kept = [2, 1, 1] if reduced == [1, 2] else [2, 3, 1]
    out_shape = kept if keepdims else kept[: 3 - len(reduced)]
    m = model(
        [
            h.make_node("Exp", ["x"], ["e"]),
            h.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=keepdims),
            h.make_node("ReduceMean", ["x"], ["m"], axes=reduced, keepdims=keepdims),
            h.make_node("ReduceMax", ["x"], ["mx"], axes=reduced, keepdims=keepdims),
        ],
        [("x", T.FLOAT, ["a", "b", "c"])],
        [(n, T.FLOAT, out_shape) for n in ("s", "m", "mx")],
        [axes("axes", reduced)],
    )
    check_against_reference(m, [x])


def test_reduction_broadcast_back_and_more_rows_than_one_block():
    # x - mean(x): the reduced value is broadcast over its row again; 33 columns need BLOCK 64
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(1))
    m = model(
        [
            h.make_node("ReduceMean", ["x"], ["m"], axes=[-1], keepdims=1),
            h.make_node("Sub", ["x", "m"], ["d"]),
            h.make_node("Mul", ["d", "d"], ["y"]),
        ],
        [("x", T.FLOAT, ["r", "c"])],
        [("y", T.FLOAT, ["r", "c"]), ("m", T.FLOAT, ["r", 1])],
    )
    check_against_reference(m, [x])


@pytest.mark.parametrize("dtype", [T.FLOAT, T.FLOAT16, T.BFLOAT16])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_opset13(op, dtype):
    x = (torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(2)) * 3).to(
        TORCH_TYPES[dtype]
    )
    m = model(
        [h.make_node(op, ["x"], ["y"], axis=-1)],
        [("x", dtype, ["a", "b", "c"])],
        [("y", dtype, ["a", "b", "c"])],
    )
    check_against_reference(m, [x])


def test_softmax_opset11_flattens_trailing_axes():
    # Oracle: torch on the 2-D view the opset-11 spec defines. onnx's reference evaluator
    # (1.23) applies the opset-13 meaning (one axis) at every opset, so it is not used here.
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3))
    m = model(
        [h.make_node("Softmax", ["x"], ["y"], axis=1)],
        [("x", T.FLOAT, [2, 3, 4])],
        [("y", T.FLOAT, [2, 3, 4])],
        opset=11,
    )
    (y,) = compile_subgraph(m)(x)
    want = torch.softmax(x.reshape(2, 12), -1).reshape(2, 3, 4)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_normalization(axis, dtype):
    gen = torch.Generator().manual_seed(4)
    tt = TORCH_TYPES[dtype]
    x = torch.randn(3, 4, 6, generator=gen).to(tt)
    norm_shape = [6] if axis == -1 else [4, 6]
    scale = torch.randn(norm_shape, generator=gen).to(tt)
    bias = torch.randn(norm_shape, generator=gen).to(tt)
    stat = [3, 4, 1] if axis == -1 else [3, 1, 1]
    m = model(
        [
            h.make_node(
                "LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=axis, epsilon=1e-5
            )
        ],
        [("x", dtype, ["a", 4, 6]), ("s", dtype, norm_shape), ("b", dtype, norm_shape)],
        [("y", dtype, ["a", 4, 6]), ("mean", T.FLOAT, stat), ("inv", T.FLOAT, stat)],
    )
    check_against_reference(m, [x, scale, bias])


def run_one(nodes, inputs, outputs, feeds):
    return compile_subgraph(model(nodes, inputs, outputs))(*feeds)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), **TOLERANCE[got.dtype])


@pytest.mark.parametrize("dtype", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_grad_against_autograd(log, dtype):
    gen = torch.Generator().manual_seed(5)
    tt = TORCH_TYPES[dtype]
    x = torch.randn(3, 7, generator=gen, requires_grad=True)
    dy = torch.randn(3, 7, generator=gen)
    y = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    (dx,) = torch.autograd.grad(y, x, dy)
    op = "LogSoftmaxGrad_13" if log else "SoftmaxGrad_13"
    (got,) = run_one(
        [h.make_node(op, ["dy", "y"], ["dx"], domain=MS, axis=-1)],
        [("dy", dtype, ["a", "b"]), ("y", dtype, ["a", "b"])],
        [("dx", dtype, ["a", "b"])],
        [dy.to(tt), y.detach().to(tt)],
    )
    close(got, dx)


def test_layer_normalization_grad_against_autograd():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 2, 8, generator=gen, requires_grad=True)
    scale = torch.randn(8, generator=gen, requires_grad=True)
    bias = torch.randn(8, generator=gen, requires_grad=True)
    dy = torch.randn(5, 2, 8, generator=gen)
    y = torch.nn.functional.layer_norm(x, (8,), scale, bias, eps=1e-5)
    want = torch.autograd.grad(y, (x, scale, bias), dy)
    mean = x.detach().mean(-1, keepdim=True)
    inv = 1.0 / torch.sqrt(x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5)
    got = run_one(
        [
            h.make_node(
                "LayerNormalizationGrad",
                ["dy", "x", "scale", "mean", "inv"],
                ["dx", "dscale", "dbias"],
                domain=MS,
                axis=-1,
            )
        ],
        [
            ("dy", T.FLOAT, ["a", 2, 8]),
            ("x", T.FLOAT, ["a", 2, 8]),
            ("scale", T.FLOAT, [8]),
            ("mean", T.FLOAT, ["a", 2, 1]),
            ("inv", T.FLOAT, ["a", 2, 1]),
        ],
        [("dx", T.FLOAT, ["a", 2, 8]), ("dscale", T.FLOAT, [8]), ("dbias", T.FLOAT, [8])],
        [dy, x.detach(), scale.detach(), mean, inv],
    )
    for g, w in zip(got, want, strict=True):
        close(g, w)


@pytest.mark.parametrize(
    ("op", "fn", "by_output"),
    [
        ("GeluGrad", lambda x: torch.nn.functional.gelu(x), False),
        ("FastGeluGrad", lambda x: torch.nn.functional.gelu(x, approximate="tanh"), False),
        ("ReluGrad", torch.relu, False),
        ("SigmoidGrad", torch.sigmoid, True),
        ("TanhGrad", torch.tanh, True),
    ],
)
def test_activation_grads_against_autograd(op, fn, by_output):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 9, generator=gen) * 2).requires_grad_(True)
    dy = torch.randn(4, 9, generator=gen)
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    second = y.detach() if by_output else x.detach()
    (got,) = run_one(
        [h.make_node(op, ["dy", "x"], ["dx"], domain=MS)],
        [("dy", T.FLOAT, ["a", "b"]), ("x", T.FLOAT, ["a", "b"])],
        [("dx", T.FLOAT, ["a", "b"])],
        [dy, second],
    )
    close(got, dx)


def test_bias_gelu_and_fast_gelu_forward():
    gen = torch.Generator().manual_seed(8)
    x, b = torch.randn(3, 6, generator=gen) * 2, torch.randn(6, generator=gen)
    got = run_one(
        [
            h.make_node("BiasGelu", ["x", "b"], ["g"], domain=MS),
            h.make_node("FastGelu", ["x", "b"], ["f"], domain=MS),
        ],
        [("x", T.FLOAT, ["a", 6]), ("b", T.FLOAT, [6])],
        [("g", T.FLOAT, ["a", 6]), ("f", T.FLOAT, ["a", 6])],
        [x, b],
    )
    close(got[0], torch.nn.functional.gelu(x + b))
    close(got[1], torch.nn.functional.gelu(x + b, approximate="tanh"))


def test_non_trailing_reduction_is_refused_with_the_axes():
    m = model(
        [h.make_node("ReduceMean", ["x"], ["y"], axes=[0], keepdims=1, name="col_mean")],
        [("x", T.FLOAT, [3, 4])],
        [("y", T.FLOAT, [1, 4])],
    )
    with pytest.raises(TritonCodegenError, match=r"col_mean.*reduces axes \[0\].*trailing"):
        compile_subgraph(m)
