"""LayerNorm with input, weight and bias all trained (a frozen one stays on the engine): the
engine's ``LayerNormalization`` + ``LayerNormalizationGrad`` or PyTorch's ``native_layer_norm``
and its backward as ATen nodes. Keyed by the normalized shape, sized by the traced rows.

>>> from ortmodule_exporter.aten.kernel_choice import measure_layer_norm
>>> engine_us, torch_us = measure_layer_norm(64, [32])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...torchscript_onnx import symbolic_helper as sh
from ..executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from ..gradients import GradientNode, register_aten_gradient, register_stop_gradient_edges
from ..output_shapes import Shape, register_output_shapes
from .choice import _decide, _size_class
from .fx_nodes import (
    AtenChoice,
    fx_arg,
    fx_float32,
    fx_ints,
    fx_needs_grad,
    fx_sizes,
    register_fx_kernel_choice,
)
from .helpers import _all_tensors, _dtype, _ints_const
from .measuring import _engine_us, _randn, _seeded, _torch_us
from .registry import CoveredOperator, _opset9, register_kernel_choice
from .traced import _traced

LAYER_NORM = "_ortmodule_layer_norm"
LAYER_NORM_BACKWARD = "_ortmodule_layer_norm_backward"


def _layer_norm(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, weight, bias, shape, eps = inputs
    assert x is not None and shape is not None and eps is not None
    return list(torch.ops.aten.native_layer_norm(x, shape.tolist(), weight, bias, eps.item()))


def _layer_norm_backward(
    _overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x, mean, rstd, weight, bias, shape = inputs
    assert grad is not None and x is not None and shape is not None
    return list(
        torch.ops.aten.native_layer_norm_backward(
            grad, x, shape.tolist(), mean, rstd, weight, bias, [True, True, True]
        )
    )


register_aten_function(LAYER_NORM, AtenFunction(_layer_norm, _all_tensors))
register_aten_function(LAYER_NORM_BACKWARD, AtenFunction(_layer_norm_backward, _all_tensors))
register_aten_gradient(
    LAYER_NORM,
    "",
    [
        GradientNode.aten(
            LAYER_NORM_BACKWARD,
            ["GO(0)", "I(0)", "O(1)", "O(2)", "I(1)", "I(2)", "I(3)"],
            ["GI(0)", "GI(1)", "GI(2)"],
        )
    ],
)
register_stop_gradient_edges(LAYER_NORM, "", [3, 4])


def _layer_norm_shapes(shapes: Sequence[Shape | None], _overload: str) -> list[Shape | None]:
    """``y`` has the input's shape; ``mean`` and ``rstd`` too, with 1 in the ``k`` normalized
    dims (``k``: the length of the normalized-shape input)."""
    x, normalized = shapes[0], shapes[3]
    if x is None:
        return [None, None, None]
    k = normalized[0] if normalized is not None and len(normalized) == 1 else None
    stats = [*x[: len(x) - k], *[1] * k] if isinstance(k, int) and 0 < k <= len(x) else None
    return [list(x), stats, stats]


register_output_shapes(LAYER_NORM, _layer_norm_shapes)


def measure_layer_norm(rows: int, normalized_shape: Sequence[int]) -> tuple[float, float]:
    """Microseconds of LayerNorm forward + backward (input, weight and bias gradients) on
    ``rows`` rows of ``normalized_shape``: (engine, torch). Engine: ``LayerNormalization`` +
    ``LayerNormalizationGrad``; PyTorch: ``native_layer_norm`` and its backward, two ATen
    nodes."""
    from onnx import helper

    shape = list(normalized_shape)
    axis = -len(shape)
    _seeded()
    x, dy = _randn(rows, *shape), _randn(rows, *shape)
    w, b = _randn(*shape), _randn(*shape)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "w", "b"], ["y", "mean", "rstd"], axis=axis),
        helper.make_node(
            "LayerNormalizationGrad",
            ["dy", "x", "w", "mean", "rstd"],
            ["dx", "dw", "db"],
            domain="com.microsoft",
            axis=axis,
        ),
    ]
    feeds = {"x": x, "w": w, "b": b, "dy": dy}
    engine_us = _engine_us("layer_norm", nodes, feeds, ["y", "dx", "dw", "db"])
    params = [torch.tensor(shape), torch.tensor(1e-5, dtype=torch.float64)]

    def torch_route() -> None:
        _y, mean, rstd = _layer_norm("", [x, w, b, *params])
        _layer_norm_backward("", [dy, x, mean, rstd, w, b, params[0]])

    return engine_us, _torch_us(torch_route, engine_us=engine_us)


def _layer_norm_symbolic(
    default: Callable[..., Any],
    g: Any,
    x: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    cudnn_enable: Any,
) -> Any:
    args = (x, normalized_shape, weight, bias, eps, cudnn_enable)
    dtype = _dtype(x)
    shape = sh._maybe_get_const(normalized_shape, "is")
    eps_value = sh._maybe_get_const(eps, "f")
    traced = _traced(g)
    if (
        dtype != "Float"
        or sh._is_none(weight)
        or sh._is_none(bias)
        or not isinstance(shape, list)
        or not isinstance(eps_value, float)
        or traced is None
        # input, weight and bias all need their gradient (a frozen LayerNorm stays on the engine)
        or len(traced.needs_grad) != 3
        or not all(traced.needs_grad)
        or not traced.sizes
        or traced.sizes[0] is None
    ):
        return default(g, *args)
    cols = math.prod(shape)
    rows = _size_class(math.prod(traced.sizes[0]) // max(cols, 1))
    route = _decide(
        f"layer_norm({'x'.join(map(str, shape))})",
        dtype,
        rows,
        lambda: measure_layer_norm(rows, shape),
    )
    if route != "torch":
        return default(g, *args)
    eps_const = g.op("Constant", value_t=torch.tensor(eps_value, dtype=torch.float64))
    y, mean, rstd = g.op(
        f"{ATEN_DOMAIN}::ATen",
        x,
        weight,
        bias,
        _ints_const(g, shape),
        eps_const,
        operator_s=LAYER_NORM,
        overload_name_s="",
        outputs=3,
    )
    y.setType(x.type())
    # the statistics keep the input's rank (size 1 in the normalized dims)
    for stat in (mean, rstd):
        stat.setType(x.type().with_sizes([None] * len(traced.sizes[0])))
    return y


register_kernel_choice(
    CoveredOperator("aten::layer_norm", _layer_norm_symbolic, _opset9("layer_norm"), opset=17)
)


def _layer_norm_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`_layer_norm_symbolic` (``layer_norm`` and
    ``native_layer_norm``, whose three outputs are the ATen node's)."""
    x, weight, bias = fx_arg(node, 0, "input"), fx_arg(node, 2, "weight"), fx_arg(node, 3, "bias")
    shape = fx_ints(fx_arg(node, 1, "normalized_shape"))
    eps = fx_arg(node, 4, "eps", 1e-5)
    sizes = fx_sizes(x)
    if (
        not fx_float32(x)
        or not isinstance(weight, torch.fx.Node)
        or not isinstance(bias, torch.fx.Node)
        or shape is None
        or not isinstance(eps, float)
        # input, weight and bias all need their gradient (a frozen LayerNorm stays on the engine)
        or not all(fx_needs_grad(v) for v in (x, weight, bias))
        or sizes is None
    ):
        return None
    cols = math.prod(shape)
    rows = _size_class(math.prod(sizes) // max(cols, 1))
    label = f"layer_norm({'x'.join(map(str, shape))})"
    if _decide(label, "Float", rows, lambda: measure_layer_norm(rows, shape)) != "torch":
        return None
    native = node.target == torch.ops.aten.native_layer_norm.default
    return AtenChoice(
        LAYER_NORM,
        "",
        (x, weight, bias, np.array(shape, np.int64), np.array(eps, np.float64)),
        extra_outputs=() if native else ((torch.float32, len(sizes)),) * 2,
        listed=3 if native else 0,
    )


register_fx_kernel_choice(
    [torch.ops.aten.layer_norm.default, torch.ops.aten.native_layer_norm.default], _layer_norm_fx
)
