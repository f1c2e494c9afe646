"""Elementwise kernels against onnx's reference evaluator, under Triton's interpreter on CPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import TORCH_TYPES, check_against_reference, model
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from ortmodule_triton import TritonCodegenError, compile_subgraph


def scalar(name: str, value: float, dtype: type = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=dtype), name)


UNARY = ["Sqrt", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu", "Neg", "Abs", "Reciprocal"]


@pytest.mark.parametrize("op", UNARY)
def test_unary_chain_fp32(op):
    # Add(x, bias) -> op -> Mul(., 2): a broadcast input, the op and a scalar initializer literal
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(3, 5, generator=gen) + 0.5  # positive, for Sqrt/Log/Reciprocal
    bias = torch.randn(5, generator=gen) * 0.1
    m = model(
        [
            h.make_node("Add", ["x", "b"], ["s"]),
            h.make_node(op, ["s"], ["u"]),
            h.make_node("Mul", ["u", "two"], ["y"]),
        ],
        [("x", T.FLOAT, ["a", "n"]), ("b", T.FLOAT, ["n"])],
        [("y", T.FLOAT, ["a", "n"])],
        [scalar("two", 2.0)],
    )
    check_against_reference(m, [x, bias])


@pytest.mark.parametrize("dtype", [T.FLOAT, T.FLOAT16, T.BFLOAT16])
def test_binary_ops_broadcast_and_half_precision(dtype):
    gen = torch.Generator().manual_seed(1)
    tt = TORCH_TYPES[dtype]
    a = torch.randn(2, 3, 4, generator=gen).to(tt)
    b = (torch.rand(3, 1, generator=gen) + 0.5).to(tt)
    c = torch.randn(4, generator=gen).to(tt)
    m = model(
        [
            h.make_node("Sub", ["a", "c"], ["s"]),
            h.make_node("Div", ["s", "b"], ["d"]),
            h.make_node("Mul", ["d", "c"], ["p"]),
            h.make_node("Max", ["p", "a"], ["mx"]),
            h.make_node("Min", ["mx", "b"], ["y"]),
            h.make_node("Tanh", ["d"], ["t"]),
        ],
        [("a", dtype, [2, 3, 4]), ("b", dtype, [3, 1]), ("c", dtype, [4])],
        [("y", dtype, [2, 3, 4]), ("t", dtype, [2, 3, 4])],
    )
    check_against_reference(m, [a, b, c])


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -1.0, 1.7])
def test_pow_constant_exponent(exponent):
    x = torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) + 0.1
    m = model(
        [h.make_node("Pow", ["x", "e"], ["y"])],
        [("x", T.FLOAT, ["a", "b"])],
        [("y", T.FLOAT, ["a", "b"])],
        [scalar("e", exponent)],
    )
    check_against_reference(m, [x])


def test_pow_tensor_exponent():
    gen = torch.Generator().manual_seed(3)
    x, e = torch.rand(3, 4, generator=gen) + 0.1, torch.randn(3, 4, generator=gen)
    m = model(
        [h.make_node("Pow", ["x", "e"], ["y"])],
        [("x", T.FLOAT, [3, 4]), ("e", T.FLOAT, [3, 4])],
        [("y", T.FLOAT, [3, 4])],
    )
    check_against_reference(m, [x, e])


def test_where_comparisons_and_casts():
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    m = model(
        [
            h.make_node("Greater", ["x", "y"], ["gt"]),
            h.make_node("LessOrEqual", ["x", "zero"], ["le"]),
            h.make_node("And", ["gt", "le"], ["both"]),
            h.make_node("Not", ["both"], ["neither"]),
            h.make_node("Where", ["gt", "x", "y"], ["w"]),
            h.make_node("Cast", ["w"], ["half"], to=T.FLOAT16),
            h.make_node("Cast", ["gt"], ["as_float"], to=T.FLOAT),
            h.make_node("Mul", ["w", "three"], ["w3"]),
            h.make_node("Cast", ["w3"], ["as_int"], to=T.INT64),
        ],
        [("x", T.FLOAT, ["a", "b"]), ("y", T.FLOAT, ["a", "b"])],
        [
            ("neither", T.BOOL, ["a", "b"]),
            ("half", T.FLOAT16, ["a", "b"]),
            ("as_float", T.FLOAT, ["a", "b"]),
            ("as_int", T.INT64, ["a", "b"]),
        ],
        [scalar("zero", 0.0), scalar("three", 3.0)],
    )
    check_against_reference(m, [x, y])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_opset20(approximate):
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(5)) * 3
    m = model(
        [h.make_node("Gelu", ["x"], ["y"], approximate=approximate)],
        [("x", T.FLOAT, ["a", "b"])],
        [("y", T.FLOAT, ["a", "b"])],
        opset=20,
    )
    check_against_reference(m, [x])


def test_erf_gelu_as_torch_exports_it():
    # torch.nn.GELU at opset 17: Div by sqrt(2), Erf, Add 1, Mul x, Mul 0.5
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(6))
    m = model(
        [
            h.make_node("Div", ["x", "sqrt2"], ["d"]),
            h.make_node("Erf", ["d"], ["e"]),
            h.make_node("Add", ["e", "one"], ["p"]),
            h.make_node("Mul", ["x", "p"], ["q"]),
            h.make_node("Mul", ["q", "half"], ["y"]),
        ],
        [("x", T.FLOAT, ["a", "b"])],
        [("y", T.FLOAT, ["a", "b"])],
        [scalar("sqrt2", 2**0.5), scalar("one", 1.0), scalar("half", 0.5)],
    )
    check_against_reference(m, [x])
    got = compile_subgraph(m)(x)[0]
    torch.testing.assert_close(got, torch.nn.functional.gelu(x), rtol=1e-4, atol=1e-5)


def test_one_kernel_serves_every_shape():
    """Symbolic dims: the shapes are kernel arguments, so one compiled kernel runs them all."""
    m = model(
        [h.make_node("Add", ["x", "b"], ["s"]), h.make_node("Sigmoid", ["s"], ["y"])],
        [("x", T.FLOAT, ["batch", "seq", "hidden"]), ("b", T.FLOAT, ["hidden"])],
        [("y", T.FLOAT, ["batch", "seq", "hidden"])],
    )
    kernel = compile_subgraph(m)
    gen = torch.Generator().manual_seed(7)
    for shape in [(1, 1, 3), (2, 5, 3), (3, 2, 7), (2, 700, 2)]:  # 2800 elements: 3 programs
        x, b = torch.randn(shape, generator=gen), torch.randn(shape[-1], generator=gen)
        (y,) = kernel(x, b)
        torch.testing.assert_close(y, torch.sigmoid(x + b), rtol=1e-4, atol=1e-5)


def test_large_initializer_becomes_a_kernel_input():
    table = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(8))
    m = model(
        [h.make_node("Mul", ["x", "table"], ["y"])],
        [("x", T.FLOAT, ["n", 2, 3])],
        [("y", T.FLOAT, ["n", 2, 3])],
        [numpy_helper.from_array(table, "table")],
    )
    check_against_reference(m, [x])


def test_unsupported_op_names_node_and_op():
    m = model(
        [h.make_node("MatMul", ["x", "x"], ["y"], name="mm")],
        [("x", T.FLOAT, [2, 2])],
        [("y", T.FLOAT, [2, 2])],
    )
    with pytest.raises(TritonCodegenError, match=r"node mm: op ai.onnx::MatMul is not supported"):
        compile_subgraph(m)


def test_wrong_input_dtype_is_named():
    m = model([h.make_node("Relu", ["x"], ["y"])], [("x", T.FLOAT, ["n"])], [("y", T.FLOAT, ["n"])])
    with pytest.raises(TypeError, match=r"input 'x' must be a rank-1 torch.float32 tensor"):
        compile_subgraph(m)(torch.ones(3, dtype=torch.float64))
