"""The gradient of a 0-d tensor keeps rank 0 (a built-graph pass).

Several of the engine's gradient builders combine a gradient with a float constant of shape
``(1,)`` (``Sqrt``: ``dY * (0.5 / Y)``; ``Pow``: ``X ** (p - 1)``), so ONNX broadcasting turns
the gradient of a 0-d tensor into shape ``(1,)``. Later gradient nodes then work at the wrong
rank and the result is silently wrong: the gradient of a ``ReduceSum`` over explicit axes
unsqueezes that ``(1,)`` to one dimension more than its input had, and the next broadcasting
gradient reduces over the wrong axes. ``x.var(dim=(0, 1, 2)).sqrt()`` came back 16% off and
``torch.masked.std`` 3% off.

The fix: such a constant, read only by broadcasting elementwise nodes of the backward half,
becomes 0-d. Broadcasting with a 0-d tensor never changes the other operand's rank, so a
gradient whose forward tensor has rank 1 or more is unchanged.

>>> from ortmodule_exporter.passes.scalar_gradients import keep_scalar_gradients
>>> keep_scalar_gradients(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import onnx

from ..onnx_graph import FLOAT_TYPES
from .built_graph import register_built_graph_pass

__all__ = ["keep_scalar_gradients"]

#: the node the engine puts between the forward and the backward half of a training graph
_YIELD = "YieldOp"
#: elementwise operators whose output takes the broadcast shape of their inputs
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean"})


def keep_scalar_gradients(model: onnx.ModelProto) -> int:
    """Make the backward half's float ``(1,)`` constants 0-d; returns how many changed."""
    graph = model.graph
    nodes = list(graph.node)
    split = next((i for i, n in enumerate(nodes) if n.op_type == _YIELD), None)
    if split is None:
        return 0  # an inference graph: no gradients
    readers: dict[str, list[tuple[int, onnx.NodeProto]]] = {}
    for position, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append((position, node))
    outputs = {vi.name for vi in graph.output}
    changed = 0
    for init in graph.initializer:
        if list(init.dims) != [1] or init.data_type not in FLOAT_TYPES or init.name in outputs:
            continue
        uses = readers.get(init.name, [])
        if uses and all(
            position > split and node.op_type in _BROADCASTING and node.domain in ("", "ai.onnx")
            for position, node in uses
        ):
            del init.dims[:]
            changed += 1
    return changed


def _pass(model: onnx.ModelProto, _config: Any) -> bool:
    return keep_scalar_gradients(model) > 0


register_built_graph_pass("scalar_gradients", _pass, order=10)
