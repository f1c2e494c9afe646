"""The logits' outside gradient added inside the loss's backward (a built-graph pass).

A causal LM returns its logits and computes its loss from them in the graph, so the logits
have two gradients: the loss's, and whatever autograd hands in for the output (a 0-d zero
where the user did not use the logits: ``engine.summed_output_grads``). The engine's gradient
builder adds the two with a broadcasting ``Add`` into a new tensor of the logits' size: at
GPT-2 124M (batch 4 x 256, 50257 classes) a 206 MB buffer written each step, 51 ms on the
2-core Xeon without the arena, and a third logits-sized tensor alive beside the logits and
their gradient at the start of the backward. Where the loss's gradient is PyTorch's
(``_ortmodule_cross_entropy_backward``, the kernel choice's route, reshaped once to the logits'
shape) and nothing else reads it, the node instead takes the outside gradient and the shape as
two more inputs and adds it in place (overload ``adds_output_grad``; nothing where it is a 0-d
zero); the ``Reshape`` then writes the ``Add``'s output and the ``Add`` is gone.

The sum is the same: one addition per element, of the same two values.

>>> from ortmodule_exporter.passes.output_grad_sums import add_output_grads_in_loss
>>> add_output_grads_in_loss(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import onnx

from ..aten.kernel_choice import ADDS_OUTPUT_GRAD, cross_entropy_backward_overload
from ..onnx_graph import attribute, producers_and_consumers, set_attribute
from .built_graph import register_built_graph_pass

__all__ = ["add_output_grads_in_loss"]


def add_output_grads_in_loss(model: onnx.ModelProto) -> int:
    """Fold each ``Add`` of a ``YieldOp`` output and a reshaped PyTorch loss gradient into the
    loss gradient's node; returns how many."""
    graph = model.graph
    yielded = {name for n in graph.node if n.op_type == "YieldOp" for name in n.output}
    if not yielded:
        return 0
    producers, readers = producers_and_consumers(graph)
    outputs = {vi.name for vi in graph.output}
    position = {id(n): i for i, n in enumerate(graph.node)}
    removed: set[int] = set()
    for add in graph.node:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
            continue
        outside = next((name for name in add.input if name in yielded), None)
        if outside is None or add.input[0] == add.input[1]:
            continue
        reshaped = add.input[1] if add.input[0] == outside else add.input[0]
        reshape = producers.get(reshaped)
        if (
            reshape is None
            or reshape.op_type != "Reshape"
            or attribute(reshape, "allowzero", 0) != 0
            or len(readers.get(reshaped, [])) != 1
            or reshaped in outputs
        ):
            continue
        loss_grad = producers.get(reshape.input[0])
        if (
            loss_grad is None
            or cross_entropy_backward_overload(loss_grad) != ""
            or len(readers.get(reshape.input[0], [])) != 1
            or reshape.input[0] in outputs
        ):
            continue
        # the node reads the shape where it runs: it must be computed before it
        shape_source = producers.get(reshape.input[1])
        if shape_source is not None and position[id(shape_source)] > position[id(loss_grad)]:
            continue
        loss_grad.input.extend([outside, reshape.input[1]])
        set_attribute(loss_grad, "overload_name", ADDS_OUTPUT_GRAD)
        reshape.output[0] = add.output[0]
        removed.add(id(add))
    if not removed:
        return 0
    kept = [n for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    return len(removed)


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return add_output_grads_in_loss(model) > 0


register_built_graph_pass("output_grad_sums", _pass, order=66)
