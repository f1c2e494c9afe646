"""Forwards back on the engine's kernel where only the backward runs on PyTorch's (a built-graph
pass).

The kernel choice times an operator's forward and backward apart where the engine's two kernels
differ: on the 2-core EPYC the engine's ``Relu`` is as quick as PyTorch's ``relu`` in an ATen
node, its ``ReluGrad`` six times slower than ``threshold_backward`` on a CNN's activations
(``benchmarks/results/2026-11-23-relu-backward-amd-epyc-2c.md``). The engine builds an ATen
node's gradient only from the node itself, so such an operator is exported as an ATen node of
overload :data:`~ortmodule_exporter.aten.kernel_choice.ENGINE_FORWARD` (its gradient is
PyTorch's), and once the gradient graph is built this pass turns that forward node into the
engine's own (:data:`~ortmodule_exporter.aten.kernel_choice.ENGINE_FORWARDS`). A graph this pass
does not reach computes the same values, the forward on PyTorch.

>>> from ortmodule_exporter.passes.engine_forwards import engine_forwards
>>> engine_forwards(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import ENGINE_FORWARD, ENGINE_FORWARDS
from ..onnx_graph import attribute
from .built_graph import register_built_graph_pass

__all__ = ["engine_forwards"]


def engine_forwards(model: onnx.ModelProto) -> int:
    """Rewrite every ATen node of overload ``ENGINE_FORWARD`` into the engine's node for its
    operator; returns how many were rewritten."""
    graph = model.graph
    changed = 0
    for position, node in enumerate(list(graph.node)):
        if node.op_type != "ATen" or node.domain != ATEN_DOMAIN:
            continue
        if attribute(node, "overload_name", "") != ENGINE_FORWARD:
            continue
        op_type = ENGINE_FORWARDS.get(attribute(node, "operator", ""))
        if op_type is None:
            continue
        graph.node[position].CopyFrom(
            onnx.helper.make_node(op_type, list(node.input), list(node.output), name=node.name)
        )
        changed += 1
    return changed


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return engine_forwards(model) > 0


register_built_graph_pass("engine_forwards", _pass, order=55)
