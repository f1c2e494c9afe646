"""A forward output that the graph names through an ``Identity`` of one of our products is
written by the product itself (a built-graph pass).

The exporter names a user output with an ``Identity`` where the value is also an intermediate
(a causal LM's logits: the output head's product, also read by the loss). Since an engine bug
(``execution._viewed_outputs``) makes ORTModule copy every forward output that is a view of
another value, the logits were copied at the end of each forward: at GPT-2 124M (batch
4 x 256) a 206 MB copy, and the step's peak, since the engine keeps the product's output for
the loss's backward beside the copy. Where the ``Identity`` reads the output of a
``_ortmodule_matmul`` node (``passes/matmul_routes.py``: a tensor PyTorch allocated, never a
view of an input) and nothing else reads it, the product writes the output itself and the
``Identity`` goes: the output is then a node's own result, like any other that is not copied.

>>> from ortmodule_exporter.passes.product_outputs import name_outputs_at_products
>>> name_outputs_at_products(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import MATMUL
from ..onnx_graph import attribute, producers_and_consumers, rename_values
from .built_graph import register_built_graph_pass

__all__ = ["name_outputs_at_products"]


def name_outputs_at_products(model: onnx.ModelProto) -> int:
    """Drop each ``Identity`` that names a forward output after a product node's output read by
    it alone; returns how many."""
    graph = model.graph
    forward_outputs = {name for n in graph.node if n.op_type == "YieldOp" for name in n.input} | {
        vi.name for vi in graph.output
    }
    producers, readers = producers_and_consumers(graph)
    kept_names = {vi.name for vi in (*graph.input, *graph.output)}
    renames: dict[str, str] = {}
    removed: set[int] = set()
    for node in graph.node:
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        source, output = node.input[0], node.output[0]
        product = producers.get(source)
        if (
            output not in forward_outputs
            or product is None
            or product.domain != ATEN_DOMAIN
            or attribute(product, "operator", "") != MATMUL
            or len(readers.get(source, [])) != 1
            or source in kept_names
        ):
            continue
        renames[source] = output
        removed.add(id(node))
    if not removed:
        return 0
    kept = [n for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    # the engine must know the ATen node's output type (it cannot infer it): the product's
    # declared type goes to the output, unless the output declares its own (one entry a name)
    declared = {vi.name for vi in (*graph.value_info, *graph.output)}
    infos = [
        vi for vi in graph.value_info if vi.name not in renames or renames[vi.name] not in declared
    ]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    rename_values(graph, renames)
    return len(removed)


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return name_outputs_at_products(model) > 0


register_built_graph_pass("product_outputs", _pass, order=69)
