"""Convolution (``aten::_convolution``, not transposed, float32, input needing a gradient): the
engine's ``Conv`` + ``ConvGrad`` or PyTorch's ``convolution`` and ``convolution_backward`` as
ATen nodes. Keyed by the weight's shape and the settings, sized by the traced input's shape
(unknown: the engine's kernel stays).

>>> from ortmodule_exporter.aten.kernel_choice import measure_conv
>>> engine_us, torch_us = measure_conv((2, 4, 8, 8), (4, 4, 3, 3), (1, 1), (1, 1), (1, 1))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...torchscript_onnx import symbolic_helper as sh
from ...torchscript_onnx import symbolic_opset9
from ..executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from ..gradients import GradientNode, register_aten_gradient, register_stop_gradient_edges
from .choice import _decide
from .fx_nodes import (
    AtenChoice,
    fx_arg,
    fx_float32,
    fx_ints,
    fx_needs_grad,
    fx_sizes,
    register_fx_kernel_choice,
)
from .helpers import _all_tensors, _dtype, _ints_const, _per_dim
from .measuring import _engine_us, _randn, _seeded, _torch_us
from .registry import CoveredOperator, register_kernel_choice
from .traced import _traced

CONV = "_ortmodule_conv"
CONV_BACKWARD = "_ortmodule_conv_backward"


@dataclass(frozen=True)
class _ConvSettings:
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def params(self) -> list[int]:
        return [*self.stride, *self.padding, *self.dilation, self.groups]

    @classmethod
    def parse(cls, params: Sequence[int], n: int) -> _ConvSettings:
        return cls(
            tuple(params[:n]), tuple(params[n : 2 * n]), tuple(params[2 * n : 3 * n]), params[3 * n]
        )


# Overloads: "xw" without bias, "xwb" with one. The engine builds every input gradient a
# gradient definition writes and fails when nobody needs one (a convolution of the model's input:
# "invalid index -1"; a definition without the input's gradient was refused too, "failed to find
# NodeArg <weight>_grad"), so only convolutions whose input needs a gradient are routed.
_CONV_OVERLOADS = ("xw", "xwb")


def _conv(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, weight, *rest = inputs
    assert x is not None and weight is not None and rest[-1] is not None
    bias = rest[0] if "b" in overload else None
    n = weight.dim() - 2
    s = _ConvSettings.parse(rest[-1].tolist(), n)
    # whole, not in pieces (see aten/parallel.py)
    return [
        torch.convolution(
            x, weight, bias, s.stride, s.padding, s.dilation, False, [0] * n, s.groups
        )
    ]


def _conv_backward(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    grad, x, weight, params = inputs
    assert grad is not None and x is not None and weight is not None and params is not None
    n = weight.dim() - 2
    s = _ConvSettings.parse(params.tolist(), n)
    mask = ["x" in overload, True, "b" in overload]
    grads = torch.ops.aten.convolution_backward(
        grad,
        x,
        weight,
        [weight.shape[0]] if mask[2] else None,
        s.stride,
        s.padding,
        s.dilation,
        False,
        [0] * n,
        s.groups,
        mask,
    )
    return [g for g, wanted in zip(grads, mask, strict=True) if wanted]


register_aten_function(CONV, AtenFunction(_conv, _all_tensors))
register_aten_function(CONV_BACKWARD, AtenFunction(_conv_backward, _all_tensors))
for _overload in _CONV_OVERLOADS:
    _params = "I(3)" if "b" in _overload else "I(2)"
    register_aten_gradient(
        CONV,
        _overload,
        [
            GradientNode.aten(
                CONV_BACKWARD,
                ["GO(0)", "I(0)", "I(1)", _params],
                [f"GI({i})" for i, c in enumerate("xwb") if c in _overload],
                overload=_overload,
            )
        ],
    )
    register_stop_gradient_edges(CONV, _overload, [int(_params[2])])


def measure_conv(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
    bias: bool = False,
) -> tuple[float, float]:
    """Microseconds of a convolution's forward + backward (input, weight and bias gradients):
    (engine, torch). Engine: ``Conv`` + ``ConvGrad``; PyTorch: ``convolution`` +
    ``convolution_backward`` and two ATen nodes."""
    from onnx import helper

    n = len(weight_shape) - 2
    attrs: dict[str, Any] = {
        "kernel_shape": list(weight_shape[2:]),
        "strides": list(stride),
        "pads": list(padding) * 2,
        "dilations": list(dilation),
        "group": groups,
    }
    _seeded()
    x, w = _randn(*input_shape), _randn(*weight_shape)
    b = _randn(weight_shape[0])
    y = torch.convolution(
        x, w, b if bias else None, stride, padding, dilation, False, [0] * n, groups
    )
    dy = _randn(*y.shape)
    conv_inputs = ["x", "w", "b"] if bias else ["x", "w"]
    grads = ["dx", "dw", "db"] if bias else ["dx", "dw"]
    engine_x, engine_w, engine_dy = x, w, dy
    if n == 1 and groups > 1:
        # The engine's grouped 1-D ConvGrad clears memory past its input gradient (engine bug,
        # passes/grouped_conv_grad.py), so built graphs run it as the 2-D kernel with a height
        # of 1: time that form (and never run the faulty kernel here).
        engine_x, engine_w, engine_dy = x.unsqueeze(2), w.unsqueeze(2), dy.unsqueeze(2)
        attrs.update(
            kernel_shape=[1, *weight_shape[2:]],
            strides=[1, *stride],
            pads=[0, padding[0], 0, padding[0]],
            dilations=[1, *dilation],
        )
    nodes = [
        helper.make_node("Conv", conv_inputs, ["y"], **attrs),
        helper.make_node("ConvGrad", ["dy", "x", "w"], grads, domain="com.microsoft", **attrs),
    ]
    feeds = {"x": engine_x, "w": engine_w, "dy": engine_dy, **({"b": b} if bias else {})}
    engine_us = _engine_us("conv", nodes, feeds, ["y", *grads])

    params = torch.tensor(
        _ConvSettings(tuple(stride), tuple(padding), tuple(dilation), groups).params()
    )

    def torch_route() -> None:
        (out,) = _conv("xwb" if bias else "xw", [x, w, *([b] if bias else []), params])
        torch.ops.aten.convolution_backward(
            dy,
            x,
            w,
            [w.shape[0]] if bias else None,
            stride,
            padding,
            dilation,
            False,
            [0] * n,
            groups,
            [True, True, bias],
        )
        del out

    return engine_us, _torch_us(torch_route, engine_us=engine_us)


def _conv_route(
    input_shape: Sequence[int] | None,
    weight_sizes: Sequence[int],
    settings: _ConvSettings,
    has_bias: bool,
) -> str:
    """The decision for one float32 convolution (both frontends ask it)."""
    n = len(weight_sizes) - 2
    op = (
        f"conv(weight={'x'.join(map(str, weight_sizes))},stride={settings.stride},"
        f"padding={settings.padding},dilation={settings.dilation},groups={settings.groups},"
        f"bias={int(has_bias)})"
    )
    if input_shape is None or len(input_shape) != n + 2:
        # the cost depends on the spatial sizes: without them nothing can be measured
        return _decide(op, "Float", None, lambda: (0.0, math.inf))
    shape = tuple(input_shape)
    return _decide(
        op,
        "Float",
        shape,
        lambda: measure_conv(
            shape,
            weight_sizes,
            settings.stride,
            settings.padding,
            settings.dilation,
            settings.groups,
            has_bias,
        ),
    )


def _convolution_symbolic(default: Callable[..., Any], g: Any, *args: Any) -> Any:
    x, weight, bias, stride, padding, dilation, transposed = args[:7]
    groups = args[8]
    dtype = _dtype(x)
    weight_sizes = sh._get_tensor_sizes(weight)
    if (
        dtype != "Float"
        or _dtype(weight) != "Float"
        or sh._maybe_get_const(transposed, "i")
        or weight_sizes is None
        or any(s is None for s in weight_sizes)
        or len(weight_sizes) < 3
    ):
        return default(g, *args)
    n = len(weight_sizes) - 2
    has_bias = not sh._is_none(bias)
    try:
        settings = _ConvSettings(
            tuple(_per_dim(sh._maybe_get_const(stride, "is"), n, 1)),
            tuple(_per_dim(sh._maybe_get_const(padding, "is"), n, 0)),
            tuple(_per_dim(sh._maybe_get_const(dilation, "is"), n, 1)),
            int(sh._maybe_get_const(groups, "i")),
        )
    except (TypeError, ValueError):  # a setting only known at run time
        return default(g, *args)
    traced = _traced(g)
    if traced is None or not traced.input_needs_grad:
        return default(g, *args)
    input_shape = traced.sizes[0] if traced.sizes else None
    if _conv_route(input_shape, tuple(weight_sizes), settings, has_bias) != "torch":
        return default(g, *args)
    params = _ints_const(g, settings.params())
    inputs = [x, weight, bias, params] if has_bias else [x, weight, params]
    overload = "xwb" if has_bias else "xw"
    out = g.op(
        f"{ATEN_DOMAIN}::ATen", *inputs, operator_s=CONV, overload_name_s=overload, outputs=1
    )
    out.setType(x.type().with_sizes([None, int(weight_sizes[0]), *([None] * n)]))
    return out


def _default_convolution() -> Callable[..., Any]:

    fn: Callable[..., Any] = symbolic_opset9._convolution
    return fn


register_kernel_choice(
    CoveredOperator("aten::_convolution", _convolution_symbolic, _default_convolution)
)


def _conv_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`_convolution_symbolic` (``conv1d``/``2d``/``3d`` and
    ``convolution``), sized by the example inputs."""
    x, weight, bias = fx_arg(node, 0, "input"), fx_arg(node, 1, "weight"), fx_arg(node, 2, "bias")
    general = node.target == torch.ops.aten.convolution.default
    weight_sizes = fx_sizes(weight, symbolic=False)
    if (
        not fx_float32(x)
        or not fx_float32(weight)
        or (general and fx_arg(node, 6, "transposed") is not False)
        or weight_sizes is None
        or len(weight_sizes) < 3
        or not fx_needs_grad(x)
    ):
        return None
    n = len(weight_sizes) - 2
    stride, padding, dilation = (fx_arg(node, i, name) for i, name in _CONV_SETTINGS)
    groups = fx_arg(node, 8 if general else 6, "groups", 1)
    ints = [fx_ints(v) if v is not None else [] for v in (stride, padding, dilation)]
    if any(v is None for v in ints) or not isinstance(groups, int):
        return None  # a setting only known at run time
    try:
        settings = _ConvSettings(
            tuple(_per_dim(ints[0], n, 1)),
            tuple(_per_dim(ints[1], n, 0)),
            tuple(_per_dim(ints[2], n, 1)),
            groups,
        )
    except ValueError:
        return None
    has_bias = bias is not None
    if _conv_route(fx_sizes(x), weight_sizes, settings, has_bias) != "torch":
        return None
    params = np.array(settings.params(), np.int64)
    inputs = (x, weight, bias, params) if has_bias else (x, weight, params)
    return AtenChoice(CONV, "xwb" if has_bias else "xw", inputs)


#: (position, name) of stride, padding and dilation in ``conv<n>d`` and ``convolution``
_CONV_SETTINGS = ((3, "stride"), (4, "padding"), (5, "dilation"))

register_fx_kernel_choice(
    [
        torch.ops.aten.convolution.default,
        torch.ops.aten.conv1d.default,
        torch.ops.aten.conv2d.default,
        torch.ops.aten.conv3d.default,
    ],
    _conv_fx,
)
