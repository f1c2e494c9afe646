"""Gradients select where eager's select, so NaN and Inf reach the same elements (a built-graph
pass).

PyTorch's backward formulas pick a gradient element or a zero (``where``, ``masked_fill``);
several of the engine's gradient builders multiply by a 0/1 mask instead, and ``0 * NaN`` and
``0 * Inf`` are NaN: a NaN in the incoming gradient leaked through positions eager zeroes
(``Clip``, ``Max``/``Min``: ``Mul(Cast(mask), dY)``). The engine's ``ReluGrad`` does the
opposite: it passes ``dY`` only where the ReLU's result is ``> 0``, so where that result is NaN
it gave 0 while eager's ``threshold_backward`` (zero only where the result is ``<= 0``) passes
the gradient. Measured 2026-11-26 on the 2-core CPU machine: an MLP with ReLU, MSE loss and one
NaN input element had 16 NaNs in the first weight's gradient, eager 128; ``hardtanh`` 128,
eager 16. The engine is frozen, so the built graph is rewritten:

- ``Mul(Cast(mask: bool), dY)`` in the backward half -> ``Where(mask, dY, 0)``
- ``ReluGrad(dY, Y)`` -> ``Where(LessOrEqual(Y, 0), 0, dY)`` (eager's ``threshold_backward``)

Both equal the engine's nodes wherever ``dY`` and ``Y`` are finite.

>>> from ortmodule_exporter.passes.nan_gradients import select_gradients
>>> select_gradients(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..onnx_graph import FLOAT_TYPES, attribute
from .built_graph import register_built_graph_pass

__all__ = ["select_gradients"]

_YIELD = "YieldOp"
_MS = "com.microsoft"


def _is_onnx(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


class _Zeros:
    """One 0-d zero initializer per float type, added on first use."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self._graph = graph
        self._names: dict[int, str] = {}
        self._taken = {i.name for i in graph.initializer}

    def __call__(self, elem_type: int) -> str:
        if elem_type not in self._names:
            name = f"nan_gradients_zero_{elem_type}"
            while name in self._taken:
                name += "_"
            dtype = helper.tensor_dtype_to_np_dtype(elem_type)
            self._graph.initializer.append(numpy_helper.from_array(np.zeros((), dtype), name))
            self._names[elem_type] = name
            self._taken.add(name)
        return self._names[elem_type]


def select_gradients(model: onnx.ModelProto) -> int:
    """Rewrite the backward half's masking multiplications and ``ReluGrad`` nodes into
    ``Where``; returns how many nodes were rewritten."""
    graph = model.graph
    nodes = list(graph.node)
    split = next((i for i, n in enumerate(nodes) if n.op_type == _YIELD), None)
    if split is None:
        return 0  # an inference graph: no gradients
    producer = {out: node for node in nodes for out in node.output}
    value_types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in [*graph.value_info, *graph.input, *graph.output]
    }
    zeros = _Zeros(graph)
    out: list[onnx.NodeProto] = []
    changed = 0
    for position, node in enumerate(nodes):
        if position <= split:
            out.append(node)
            continue
        if node.op_type == "Mul" and _is_onnx(node):
            mask = _bool_mask(node, producer, value_types)
            if mask is not None:
                bool_name, grad, to = mask
                out.append(
                    helper.make_node(
                        "Where", [bool_name, grad, zeros(to)], list(node.output), name=node.name
                    )
                )
                changed += 1
                continue
        if node.op_type == "ReluGrad" and node.domain == _MS and len(node.input) == 2:
            dy, y = node.input
            relu_type = value_types.get(y) or value_types.get(dy)
            if relu_type in FLOAT_TYPES:
                assert relu_type is not None
                to = relu_type
                not_positive = f"{node.output[0]}_nan_gradients_le0"
                out.append(
                    helper.make_node(
                        "LessOrEqual", [y, zeros(to)], [not_positive], name=f"{node.name}_le0"
                    )
                )
                out.append(
                    helper.make_node(
                        "Where", [not_positive, zeros(to), dy], list(node.output), name=node.name
                    )
                )
                changed += 1
                continue
        out.append(node)
    if changed:
        del graph.node[:]
        graph.node.extend(out)
    return changed


def _bool_mask(
    mul: onnx.NodeProto, producer: dict[str, onnx.NodeProto], value_types: dict[str, int]
) -> tuple[str, str, int] | None:
    """``(mask, gradient, float type)`` when ``mul`` multiplies a bool cast to float by
    another tensor, else None."""
    for i, name in enumerate(mul.input):
        cast = producer.get(name)
        if cast is None or cast.op_type != "Cast" or not _is_onnx(cast):
            continue
        to = attribute(cast, "to")
        source = cast.input[0]
        if to not in FLOAT_TYPES or value_types.get(source) != onnx.TensorProto.BOOL:
            if to not in FLOAT_TYPES or not _makes_bool(producer.get(source)):
                continue
        other = mul.input[1 - i]
        # the output keeps the Mul's shape only when the mask broadcasts into the gradient
        # (it always does in the engine's builders: the mask is the forward input's shape)
        return source, other, int(to)
    return None


#: ONNX operators whose output is always bool
_BOOL_OPS = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Not", "Xor"}
)


def _makes_bool(node: onnx.NodeProto | None) -> bool:
    return node is not None and _is_onnx(node) and node.op_type in _BOOL_OPS


def _pass(model: onnx.ModelProto, _config: Any) -> bool:
    return select_gradients(model) > 0


register_built_graph_pass("nan_gradients", _pass, order=20)
