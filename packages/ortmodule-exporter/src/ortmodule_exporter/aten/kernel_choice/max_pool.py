"""2-d max pooling (``aten::max_pool2d`` and ``aten::max_pool2d_with_indices``, input needing a
gradient): what ``symbolics/pooling.py`` exports for the engine or PyTorch's
``max_pool2d_with_indices`` and its backward as ATen nodes, pooling a channels-last copy where
that measured faster (:func:`pool_layout`). Keyed by the settings, sized by the traced input's
shape (unknown: the engine's kernel stays).

>>> from ortmodule_exporter.aten.kernel_choice import measure_max_pool2d
>>> engine_us, torch_us = measure_max_pool2d((2, 4, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1))
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...torchscript_onnx import symbolic_helper as sh
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
from .registry import CoveredOperator, _no_previous, register_kernel_choice
from .traced import _traced

logger = logging.getLogger("ortmodule.exporter")


MAX_POOL2D = "_ortmodule_max_pool2d"
MAX_POOL2D_BACKWARD = "_ortmodule_max_pool2d_backward"


def _pool_settings(params: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int], bool]:
    p = params.tolist()
    return p[0:2], p[2:4], p[4:6], p[6:8], bool(p[8])


#: the overload of MAX_POOL2D that pools a channels-last copy of its input
CHANNELS_LAST = "channels_last"
#: (input shape, settings) -> the layout pool_layout timed faster, under _LOCK
_POOL_LAYOUTS: dict[tuple[Any, ...], str] = {}
_LOCK = threading.Lock()


def pool_layout(input_shape: Sequence[int], settings: Sequence[int]) -> str:
    """The faster way for PyTorch to max-pool a contiguous (N, C, H, W) input of this shape:
    ``""`` (as is) or :data:`CHANNELS_LAST` (pool a channels-last copy, hand back contiguous
    results), timed once per shape and ``settings`` (kernel, stride, padding, dilation,
    ceil_mode, flat: the ATen node's parameter tensor) at the in-engine thread count.

    PyTorch's kernel for contiguous NCHW input walks one plane at a time; the channels-last
    one vectorises over channels. At (16, 16, 32, 32), one thread: 1417 us as is, 498 us with
    the copy in and out (297 us of it the copy). Both give the same values and indices (the
    same first-maximum-in-window rule, NaN taken as the maximum), so the choice changes no
    result; the backward stays on the NCHW kernel, which is the fast one there (58 us).
    """
    key = (tuple(input_shape), tuple(settings))
    with _LOCK:
        found = _POOL_LAYOUTS.get(key)
    if found is not None:
        return found
    found = ""
    if len(input_shape) == 4 and input_shape[1] > 1:
        _seeded()
        x = _randn(*input_shape)
        params = torch.tensor(list(settings))
        as_is = _torch_us(lambda: _max_pool2d("", [x, params]), 0)
        copied = _torch_us(lambda: _max_pool2d(CHANNELS_LAST, [x, params]), 0)
        found = CHANNELS_LAST if copied < as_is else ""
        logger.info(
            "kernel choice: max_pool2d on %s pools %s (as is %.0f us, channels-last copy %.0f us)",
            tuple(input_shape),
            "a channels-last copy" if found else "the input as is",
            as_is,
            copied,
        )
    with _LOCK:
        _POOL_LAYOUTS[key] = found
    return found


def _max_pool2d(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, params = inputs
    assert x is not None and params is not None
    # whole, not in pieces (see aten/parallel.py)
    if overload == CHANNELS_LAST and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
        values, indices = torch.ops.aten.max_pool2d_with_indices(x, *_pool_settings(params))
        return [values.contiguous(), indices.contiguous()]
    values, indices = torch.ops.aten.max_pool2d_with_indices(x, *_pool_settings(params))
    return [values, indices]


def _max_pool2d_backward(
    _overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x, indices, params = inputs
    assert grad is not None and x is not None and indices is not None and params is not None
    return [
        torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *_pool_settings(params), indices)
    ]


register_aten_function(MAX_POOL2D, AtenFunction(_max_pool2d, _all_tensors))
register_aten_function(MAX_POOL2D_BACKWARD, AtenFunction(_max_pool2d_backward, _all_tensors))
for _layout in ("", CHANNELS_LAST):  # the backward is the NCHW kernel either way
    register_aten_gradient(
        MAX_POOL2D,
        _layout,
        [GradientNode.aten(MAX_POOL2D_BACKWARD, ["GO(0)", "I(0)", "O(1)", "I(1)"], ["GI(0)"])],
    )
    register_stop_gradient_edges(MAX_POOL2D, _layout, [1])


def measure_max_pool2d(
    input_shape: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool = False,
) -> tuple[float, float]:
    """Microseconds of 2-d max pooling forward + backward: (engine, torch). Engine: what
    ``symbolics/pooling.py`` exports (``MaxPool`` for the indices, ``Gather`` from the
    flattened input) and ``GatherGrad``; PyTorch: ``max_pool2d_with_indices`` and its backward
    and two ATen nodes."""
    from onnx import TensorProto, helper

    _seeded()
    x = _randn(*input_shape)
    values, indices = torch.ops.aten.max_pool2d_with_indices(
        x, kernel, stride, padding, dilation, ceil_mode
    )
    dy = _randn(*values.shape)
    nodes = [
        helper.make_node(
            "MaxPool",
            ["x"],
            ["unused", "idx"],
            kernel_shape=list(kernel),
            strides=list(stride),
            pads=list(padding) * 2,
            dilations=list(dilation),
            ceil_mode=int(ceil_mode),
        ),
        helper.make_node("Reshape", ["x", "minus_one"], ["flat"]),
        helper.make_node("Gather", ["flat", "idx"], ["y"], axis=0),
        helper.make_node("Shape", ["flat"], ["flat_shape"]),
        helper.make_node(
            "GatherGrad", ["flat_shape", "idx", "dy"], ["dflat"], domain="com.microsoft", axis=0
        ),
    ]
    feeds = {"x": x, "dy": dy, "minus_one": torch.tensor([-1])}
    engine_us = _engine_us(
        "max_pool2d", nodes, feeds, ["y", "dflat"], {"minus_one": TensorProto.INT64}
    )

    settings = [*kernel, *stride, *padding, *dilation, int(ceil_mode)]
    params = torch.tensor(settings)
    layout = pool_layout(input_shape, settings)

    def torch_route() -> None:
        _max_pool2d(layout, [x, params])
        torch.ops.aten.max_pool2d_with_indices_backward(
            dy, x, kernel, stride, padding, dilation, ceil_mode, indices
        )

    return engine_us, _torch_us(torch_route, engine_us=engine_us)


def _max_pool2d_route(
    input_shape: Sequence[int] | None,
    k: list[int],
    s: list[int],
    p: list[int],
    d: list[int],
    ceil: bool,
) -> str:
    """The decision for one float32 2-d max pooling (both frontends ask it)."""
    op = f"max_pool2d(kernel={k},stride={s},padding={p},dilation={d},ceil_mode={int(ceil)})"
    if input_shape is None or len(input_shape) not in (3, 4):
        return _decide(op, "Float", None, lambda: (0.0, math.inf))
    shape = tuple(input_shape)
    return _decide(op, "Float", shape, lambda: measure_max_pool2d(shape, k, s, p, d, ceil))


def _max_pool2d_symbolic(with_indices: bool) -> Callable[..., Any]:
    def symbolic(
        default: Callable[..., Any],
        g: Any,
        x: Any,
        kernel: Any,
        stride: Any,
        padding: Any,
        dilation: Any,
        ceil_mode: Any,
    ) -> Any:
        args = (x, kernel, stride, padding, dilation, ceil_mode)
        dtype = _dtype(x)
        if dtype != "Float":
            return default(g, *args)
        try:
            k = _per_dim(sh._maybe_get_const(kernel, "is"), 2, 1)
            s = _per_dim(sh._maybe_get_const(stride, "is"), 2, 0)
            if not any(s):  # eager: an empty stride is the kernel
                s = list(k)
            p = _per_dim(sh._maybe_get_const(padding, "is"), 2, 0)
            d = _per_dim(sh._maybe_get_const(dilation, "is"), 2, 1)
            ceil = bool(sh._maybe_get_const(ceil_mode, "i"))
        except (TypeError, ValueError):
            return default(g, *args)
        traced = _traced(g)
        if traced is None or not traced.input_needs_grad:
            return default(g, *args)
        input_shape = traced.sizes[0] if traced.sizes else None
        if _max_pool2d_route(input_shape, k, s, p, d, ceil) != "torch":
            return default(g, *args)
        settings = [*k, *s, *p, *d, int(ceil)]
        layout = pool_layout(tuple(input_shape), settings) if input_shape else ""
        params = _ints_const(g, settings)
        values, indices = g.op(
            f"{ATEN_DOMAIN}::ATen",
            x,
            params,
            operator_s=MAX_POOL2D,
            overload_name_s=layout,
            outputs=2,
        )
        rank = len(input_shape) if input_shape is not None else sh._get_tensor_rank(x) or 4
        sizes = sh._get_tensor_sizes(x) or [None] * rank
        spatial = [*sizes[:-2], None, None]  # the leading dims stay, the pooled ones are dynamic
        values.setType(x.type().with_sizes(spatial))
        indices.setType(x.type().with_sizes(spatial).with_dtype(torch.int64))
        return (values, indices) if with_indices else values

    return symbolic


# the exporter's own max-pool symbolics (symbolics/pooling.py) are what the engine route uses
register_kernel_choice(
    CoveredOperator(
        "aten::max_pool2d", _max_pool2d_symbolic(False), _no_previous("aten::max_pool2d")
    )
)
register_kernel_choice(
    CoveredOperator(
        "aten::max_pool2d_with_indices",
        _max_pool2d_symbolic(True),
        _no_previous("aten::max_pool2d_with_indices"),
    )
)


def _max_pool2d_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`_max_pool2d_symbolic` (``max_pool2d`` and
    ``max_pool2d_with_indices``), sized by the example inputs."""
    x = fx_arg(node, 0, "self")
    settings = [
        fx_ints(fx_arg(node, i, name, default))
        for i, name, default in ((1, "kernel_size", []), (2, "stride", []), (3, "padding", 0))
    ]
    dilation = fx_ints(fx_arg(node, 4, "dilation", 1))
    ceil = fx_arg(node, 5, "ceil_mode", False)
    if (
        not fx_float32(x)
        or any(v is None for v in (*settings, dilation))
        or not isinstance(ceil, bool)
        or not fx_needs_grad(x)
    ):
        return None
    try:
        k = _per_dim(settings[0], 2, 1)
        s = _per_dim(settings[1], 2, 0)
        if not any(s):  # eager: an empty stride is the kernel
            s = list(k)
        p = _per_dim(settings[2], 2, 0)
        d = _per_dim(dilation, 2, 1)
    except ValueError:
        return None
    input_shape = fx_sizes(x)
    if _max_pool2d_route(input_shape, k, s, p, d, ceil) != "torch":
        return None
    flat = [*k, *s, *p, *d, int(ceil)]
    layout = pool_layout(input_shape, flat) if input_shape else ""
    with_indices = node.target == torch.ops.aten.max_pool2d_with_indices.default
    return AtenChoice(
        MAX_POOL2D,
        layout,
        (x, np.array(flat, np.int64)),
        extra_outputs=() if with_indices else ((torch.int64, x.meta["val"].dim()),),
        listed=2 if with_indices else 0,
    )


register_fx_kernel_choice(
    [torch.ops.aten.max_pool2d.default, torch.ops.aten.max_pool2d_with_indices.default],
    _max_pool2d_fx,
)
