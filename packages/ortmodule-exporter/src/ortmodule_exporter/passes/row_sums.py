"""Bias gradients on PyTorch's ``sum`` where it measured faster (a built-graph pass).

The engine's gradient builder writes the gradient of a bias added to a ``(batch, seq, n)``
activation as ``ReduceSum`` over axes ``[0, 1]`` (``keepdims=0``). Its CPU kernel is slow at
these shapes: in the training step of the benchmark BERT, 23 such nodes took 8 ms, about 330 us
for a 1 MB ``(8, 128, 256)`` gradient, where eager's ``sum`` took 2 ms for the same 23
(``benchmarks/results/2026-11-23-row-sums-amd-epyc-2c.md``). The node only exists once the
engine has built the gradient graph, so the kernel choice for it is made here rather than in a
symbolic: each such ``ReduceSum`` over a constant, leading run of axes of a float32 tensor
becomes an ATen node (``_ortmodule_row_sum``, overload = the number of leading axes) where
:func:`~ortmodule_exporter.aten.kernel_choice.row_sum_route` chooses PyTorch for its width.

The sums are equal up to float rounding (the summation order differs). ``ORTMODULE_KERNEL_CHOICE``
governs it like every other covered operator (``engine`` keeps every ``ReduceSum``); graphs built
for CUDA keep the engine's kernel (the timing is a CPU one).

>>> from ortmodule_exporter.passes.row_sums import route_row_sums
>>> route_row_sums(model, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import ROW_SUM, current_mode, row_sum_route
from ..onnx_graph import attribute, constant_values, value_shapes
from .built_graph import register_built_graph_pass

__all__ = ["route_row_sums"]


def _leading_axes(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> int | None:
    """How many leading axes ``node`` (a ``ReduceSum``) sums away, when they are a constant set
    ``{0 .. k-1}`` (the engine writes ``[1, 0]`` too) and the result drops them; else None."""
    if attribute(node, "keepdims", 1) != 0 or len(node.input) < 2 or not node.input[1]:
        return None
    found = constants.get(node.input[1])
    if found is None or found.dtype != np.int64 or found.ndim > 1:
        return None
    axes = sorted(int(a) for a in found.reshape(-1))
    if not axes or axes != list(range(len(axes))):
        return None
    return len(axes)


def route_row_sums(model: onnx.ModelProto, device_type: str) -> int:
    """Rewrite the float32 leading-axes ``ReduceSum`` nodes whose width the kernel choice runs
    on PyTorch; returns how many were rewritten."""
    if device_type != "cpu" or current_mode() == "engine":
        return 0
    graph = model.graph
    constants = constant_values(graph)
    shapes = value_shapes(graph)
    changed = 0
    for position, node in enumerate(list(graph.node)):
        if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx"):
            continue
        leading = _leading_axes(node, constants)
        known = shapes.get(node.output[0])
        if leading is None or known is None:
            continue
        elem_type, dims = known
        # the result is the kept (last) axis alone: a bias's gradient of a known width
        if elem_type != onnx.TensorProto.FLOAT or dims is None or len(dims) != 1 or not dims[0]:
            continue
        if row_sum_route(dims[0]) != "torch":
            continue
        graph.node[position].CopyFrom(
            onnx.helper.make_node(
                "ATen",
                [node.input[0]],
                list(node.output),
                name=f"{node.name}_row_sum",
                domain=ATEN_DOMAIN,
                operator=ROW_SUM,
                overload_name=str(leading),
            ),
        )
        changed += 1
    return changed


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return route_row_sums(model, config.device_type) > 0


register_built_graph_pass("row_sums", _pass, order=60)
