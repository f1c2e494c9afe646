"""The loss's gradient and the output head's gradient products in one node (a built-graph pass).

Where the kernel choice gave the cross-entropy and the head's products to PyTorch, the backward
of a causal LM's head is ``_ortmodule_cross_entropy_backward`` (the logits' gradient ``G``),
``Reshape``s of ``G`` (to the logits' shape, and back to two dims for the weight's product), and
two ``_ortmodule_matmul`` nodes: ``G @ W`` (the hidden states' gradient) and ``G^T @ X`` (the
weight's). ``G`` has the logits' size (206 MB at GPT-2 124M, batch 4 x 256) and is alive while
the weight's gradient is written: the step's peak. This pass makes the five nodes one,
``_ortmodule_loss_head_backward`` (``aten/kernel_choice/loss_head.py``), which works a block of
classes at a time and never holds ``G`` whole.

Matched only where nothing else reads ``G`` or its reshapes, none is a graph output, the
products take ``G`` unscaled and untransposed (``G @ W``) and transposed (``G^T @ X``), and the
hidden states' product reads ``G`` through one ``Reshape`` (whose target the node takes, to give
its output the same shape). ``ORTMODULE_KERNEL_CHOICE=engine`` writes none of these nodes, and
graphs built for CUDA are left as they are. The node goes where the later product was; where a
reader of the first product's output comes before that, the graph is left as it is.

>>> from ortmodule_exporter.passes.loss_head_grads import fuse_loss_head_grads
>>> fuse_loss_head_grads(model, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import (
    LOSS_HEAD_BACKWARD,
    MATMUL,
    cross_entropy_backward_overload,
    loss_head_overload,
    parse_matmul_overload,
)
from ..onnx_graph import attribute, producers_and_consumers
from .built_graph import register_built_graph_pass

__all__ = ["fuse_loss_head_grads"]


def _product(node: onnx.NodeProto) -> tuple[bool, bool, bool] | None:
    """``(trans_a, trans_b, graph_output)`` of an unscaled ``_ortmodule_matmul`` node without a
    bias; None for any other node."""
    if node.domain != ATEN_DOMAIN or attribute(node, "operator", "") != MATMUL:
        return None
    if len(node.input) != 2:
        return None
    trans_a, trans_b, alpha, beta, graph_output = parse_matmul_overload(
        attribute(node, "overload_name", "")
    )
    if alpha != 1.0 or beta != 0.0:
        return None
    return trans_a, trans_b, graph_output


def _aliases(
    start: str,
    readers: dict[str, list[onnx.NodeProto]],
    outputs: set[str],
) -> tuple[list[onnx.NodeProto], list[tuple[onnx.NodeProto, str, list[str]]]] | None:
    """The ``Reshape``/``Identity`` nodes reading ``start`` or one of their outputs, and every
    other reader with the value it reads and the ``Reshape`` targets on the way there; None
    where one of these values is a graph output."""
    views: list[onnx.NodeProto] = []
    ends: list[tuple[onnx.NodeProto, str, list[str]]] = []
    stack: list[tuple[str, list[str]]] = [(start, [])]
    while stack:
        value, targets = stack.pop()
        if value in outputs:
            return None
        for node in readers.get(value, []):
            plain = node.domain in ("", "ai.onnx")
            if plain and node.op_type == "Identity":
                views.append(node)
                stack.append((node.output[0], targets))
            elif (
                plain
                and node.op_type == "Reshape"
                and node.input[0] == value
                and attribute(node, "allowzero", 0) == 0
            ):
                views.append(node)
                stack.append((node.output[0], [*targets, node.input[1]]))
            else:
                ends.append((node, value, targets))
    return views, ends


def fuse_loss_head_grads(model: onnx.ModelProto, device_type: str) -> int:
    """Rewrite each PyTorch loss gradient read only by a head's two gradient products; returns
    how many."""
    if device_type != "cpu":
        return 0
    graph = model.graph
    producers, readers = producers_and_consumers(graph)
    outputs = {vi.name for vi in graph.output}
    position = {id(n): i for i, n in enumerate(graph.node)}
    placed: dict[int, onnx.NodeProto] = {}
    removed: set[int] = set()
    for loss in graph.node:
        loss_overload = cross_entropy_backward_overload(loss)
        if loss_overload is None or len(loss.output) != 1:
            continue
        found = _aliases(loss.output[0], readers, outputs)
        if found is None or len(found[1]) != 2:
            continue
        views, ends = found
        # each end a product reading G (or a view of it) as its first operand, by its
        # transposes: G @ W for the hidden states, G^T @ X for the weight
        products: dict[tuple[bool, bool], tuple[onnx.NodeProto, list[str], bool]] = {}
        for node, value, targets in ends:
            flags = _product(node)
            if flags is not None and node.input[0] == value:
                products[flags[:2]] = (node, targets, flags[2])
        hidden, weight = products.get((False, False)), products.get((True, False))
        if hidden is None or weight is None:
            continue
        (hidden_node, targets, hidden_output), (weight_node, _, weight_output) = hidden, weight
        if len(targets) != 1:
            continue
        aliased = {loss.output[0], *(v for n in views for v in n.output)}
        if hidden_node.input[1] in aliased or weight_node.input[1] in aliased:
            continue
        # the node runs where the later product ran: every input is ready there, and every
        # reader of the earlier product's output must come after it
        first, last = sorted((hidden_node, weight_node), key=lambda n: position[id(n)])
        if any(position[id(r)] < position[id(last)] for r in readers.get(first.output[0], [])):
            continue
        extra = [hidden_node.input[1], weight_node.input[1], targets[0]]
        if any(
            (p := producers.get(name)) is not None and position[id(p)] > position[id(last)]
            for name in extra
        ):
            continue
        placed[id(last)] = onnx.helper.make_node(
            "ATen",
            [*loss.input, *extra],
            [hidden_node.output[0], weight_node.output[0]],
            name=f"{loss.name}_head",
            domain=ATEN_DOMAIN,
            operator=LOSS_HEAD_BACKWARD,
            overload_name=loss_head_overload(loss_overload, hidden_output, weight_output),
        )
        removed.update(id(n) for n in (loss, first, *views))
    if not placed:
        return 0
    kept = [placed.get(id(n), n) for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    return len(placed)


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return fuse_loss_head_grads(model, config.device_type) > 0


register_built_graph_pass("loss_head_grads", _pass, order=68)
