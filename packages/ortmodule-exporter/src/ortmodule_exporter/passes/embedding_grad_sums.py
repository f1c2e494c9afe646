"""A lookup table's gradient summed with its other gradients in one pass over the table (a
built-graph pass).

A table both looked up and read whole, as a causal LM's embedding tied to its output head,
gets two gradients, which the engine's gradient builder sums: ``GatherGrad`` (or PyTorch's
``embedding_backward``, where the kernel choice gave the lookup to PyTorch) writes a zeroed
table with the looked-up rows' gradients scattered in, ``Sum`` adds it to the head's gradient
into a third table. At GPT-2 124M's 50257 x 768 table that is three 154 MB buffers and three
passes over them, to add 1024 rows: with no CPU arena (``ORTMODULE_CPU_MEM_ARENA=AUTO`` gives
it up where the products run on PyTorch) both nodes write fresh pages each step, 103 and 95
ms on the 2-core Xeon. Here the pair becomes one ATen node (``_ortmodule_embedding_grad_add``,
4 ms there): the other gradients' sum with the rows added in by ``index_add_`` (none for a
padding index's rows, as ``embedding_backward`` gives; a lookup that scales by frequency is
left). When the other gradient is the output of one of our products
(``passes/matmul_routes.py``, which runs before) that nothing else reads, the rows are added
into it in place, and that product allocates its output as a graph output's (not from the
output pool, since the user keeps the sum as ``.grad``).

Rows gathered more than once are added in index order, then onto the other gradient; the
engine sums them first: equal up to float rounding. ``ORTMODULE_KERNEL_CHOICE=engine`` keeps the
engine's nodes, and so do graphs built for CUDA (there ``index_add_`` is not deterministic).

>>> from ortmodule_exporter.passes.embedding_grad_sums import fuse_embedding_grad_sums
>>> fuse_embedding_grad_sums(model, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import (
    EMBEDDING_GRAD_ADD,
    MATMUL,
    current_mode,
    embedding_grad_add_overload,
    matmul_overload,
    parse_matmul_overload,
)
from ..onnx_graph import (
    attribute,
    constant_values,
    producers_and_consumers,
    set_attribute,
    value_shapes,
)
from .built_graph import register_built_graph_pass

__all__ = ["fuse_embedding_grad_sums"]

_MS = "com.microsoft"
_FLOAT = onnx.TensorProto.FLOAT


def _is_sum(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in ("Sum", "Add")


def _lookup_gradient(
    node: onnx.NodeProto, constants: dict[str, np.ndarray]
) -> tuple[list[str], int] | None:
    """``([size, indices, dY], padding_idx)`` of a lookup's gradient node the pass fuses: the
    engine's ``GatherGrad`` on axis 0, or an ATen ``embedding_backward`` (the kernel choice's
    PyTorch route) whose padding index is known and that neither scales by frequency nor is
    sparse; else None."""
    if node.op_type == "GatherGrad" and node.domain == _MS:
        if attribute(node, "axis", 0) != 0:
            return None
        return list(node.input[:3]), -1
    if node.domain != ATEN_DOMAIN or attribute(node, "operator", "") != "embedding_backward":
        return None
    if len(node.input) != 6:
        return None
    padding, by_freq, sparse = (constants.get(name) for name in node.input[3:6])
    if padding is None or by_freq is None or sparse is None or bool(by_freq) or bool(sparse):
        return None
    grad, indices, rows = node.input[:3]
    return [rows, indices, grad], int(padding)


def fuse_embedding_grad_sums(model: onnx.ModelProto, device_type: str) -> int:
    """Rewrite each float32 lookup gradient (:func:`_lookup_gradient`) whose only reader is a
    ``Sum`` or ``Add`` of same-typed gradients; returns how many."""
    if device_type != "cpu" or current_mode() == "engine":
        return 0
    graph = model.graph
    shapes = value_shapes(graph)
    constants = constant_values(graph)
    producers, readers = producers_and_consumers(graph)
    outputs = {vi.name for vi in graph.output}
    replaced: dict[int, onnx.NodeProto] = {}
    removed: set[int] = set()
    for grad in graph.node:
        lookup = _lookup_gradient(grad, constants)
        if lookup is None or len(grad.output) != 1:
            continue
        table = grad.output[0]
        sums = readers.get(table, [])
        if table in outputs or len(sums) != 1 or not _is_sum(sums[0]):
            continue
        total = sums[0]
        if id(total) in replaced:  # a second lookup of the table: its gradient stays
            continue
        others = [name for name in total.input if name != table]
        # the gradient read once, all summands float32 and known (a broadcast summand of another
        # shape is added as it is; the node checks the shapes when it runs)
        if len(others) != len(total.input) - 1 or not others:
            continue
        if any(shapes.get(n, (0, None))[0] != _FLOAT for n in (table, *others, total.output[0])):
            continue
        first = producers.get(others[0])
        in_place = (
            len(others) == 1
            and first is not None
            and first.domain == ATEN_DOMAIN
            and attribute(first, "operator", "") == MATMUL
            and len(readers.get(others[0], [])) == 1
            and others[0] not in outputs
        )
        if in_place:
            assert first is not None
            _allocate_as_graph_output(first)
        inputs, padding_idx = lookup
        replaced[id(total)] = onnx.helper.make_node(
            "ATen",
            [*inputs, *others],
            [total.output[0]],
            name=f"{grad.name}_add",
            domain=ATEN_DOMAIN,
            operator=EMBEDDING_GRAD_ADD,
            overload_name=embedding_grad_add_overload(in_place, padding_idx),
        )
        removed.add(id(grad))
    if not replaced:
        return 0
    kept = [replaced.get(id(n), n) for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    return len(replaced)


def _allocate_as_graph_output(product: onnx.NodeProto) -> None:
    """Turn the ``o`` flag of a ``_ortmodule_matmul`` node's overload on: its output is a plain
    tensor of its own, not a pooled buffer (``aten/kernel_choice/matmul.py``)."""
    trans_a, trans_b, alpha, beta, _ = parse_matmul_overload(attribute(product, "overload_name"))
    overload = matmul_overload(trans_a, trans_b, alpha, beta, graph_output=True)
    set_attribute(product, "overload_name", overload)


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return fuse_embedding_grad_sums(model, config.device_type) > 0


register_built_graph_pass("embedding_grad_sums", _pass, order=64)
