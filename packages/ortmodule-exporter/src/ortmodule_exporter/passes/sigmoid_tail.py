"""Every ONNX ``Sigmoid`` but silu's runs in PyTorch: the engine's is 0 in its tail.

The engine's Sigmoid kernel (1.19.2; CPU, MLAS) is accurate to about 1e-7 absolute, not
relative: 2e-4 off at x = -10, 116 % at x = -17 and 0 from x = -18 on, where the true value is
1.5e-8 and less. A gradient through a saturated sigmoid then came out 0 where eager's is small:
Hugging Face ``bailing_hybrid``'s forget gate (``lower_bound * sigmoid(...)``) had 1984 of its
``f_proj`` weight's 2048 first-step gradient elements 0 where float64 and eager have 1e-13 to
1e-9, and AdamW, which divides by each element's own gradient size, moved those weights by up
to a learning rate a step in eager and not at all in the engine. The same holds for every
gate: ``glu``'s, a torch_lib translation's, a user's ``torch.sigmoid``.

This pass makes each such node an ATen ``sigmoid`` node, which PyTorch runs inside the engine;
its gradient is PyTorch's ``sigmoid_backward`` reading the node's output (registered below,
with the shape rules that keep the graph's named dims), on both frontends and in eval graphs.

Kept on the engine: silu's form ``Mul(x, Sigmoid(x))`` (``F.silu``, a user's
``x * torch.sigmoid(x)``), which the engine fuses into one ``QuickGelu`` kernel and its
memory optimizer can recompute. Its error is |x| times the Sigmoid's: at most about 2e-6
absolute (at x = -17), and where the Sigmoid is 0 (x <= -18) silu's true gradient is itself
under 2.7e-7 in size, one term among the other tokens' in a weight's gradient. A gate, which
multiplies another value by the sigmoid, is what the pass moves. Written down in
docs/guarantees.md.

>>> from ortmodule_exporter.passes.sigmoid_tail import sigmoids_to_pytorch
>>> sigmoids_to_pytorch(model)  # done by a post-export pass; returns the nodes it moved
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.gradients import GradientNode, register_aten_gradient
from ..aten.output_shapes import input_shape, register_output_shapes
from ..onnx_graph import import_domain, producers_and_consumers
from .registry import register_post_export_pass

__all__ = ["SIGMOID", "sigmoids_to_pytorch"]

SIGMOID = "sigmoid"

register_output_shapes(SIGMOID, input_shape)
register_output_shapes("sigmoid_backward", input_shape)
register_aten_gradient(
    SIGMOID, "", [GradientNode.aten("sigmoid_backward", ["GO(0)", "O(0)"], ["GI(0)"])]
)


def _is_silu(node: onnx.NodeProto, readers: Mapping[str, list[onnx.NodeProto]]) -> bool:
    """``node`` is the Sigmoid of ``Mul(x, Sigmoid(x))``, its only reader that Mul."""
    read_by = readers.get(node.output[0], [])
    if len(read_by) != 1:
        return False
    mul = read_by[0]
    return (
        mul.op_type == "Mul"
        and mul.domain in ("", "ai.onnx")
        and sorted(mul.input) == sorted([node.input[0], node.output[0]])
    )


def sigmoids_to_pytorch(model: onnx.ModelProto) -> int:
    """Make every ONNX ``Sigmoid`` of ``model`` but silu's an ATen ``sigmoid`` node; returns how
    many it made."""
    graph = model.graph
    _, readers = producers_and_consumers(graph)
    outputs = {o.name for o in graph.output}
    moved = 0
    for slot, node in enumerate(graph.node):
        if node.op_type != "Sigmoid" or node.domain not in ("", "ai.onnx"):
            continue
        if node.output[0] not in outputs and _is_silu(node, readers):
            continue
        graph.node[slot].CopyFrom(
            onnx.helper.make_node(
                "ATen",
                [node.input[0]],
                [node.output[0]],
                name=node.name or f"sigmoid_{slot}",
                domain=ATEN_DOMAIN,
                operator=SIGMOID,
                overload_name="",
            )
        )
        moved += 1
    if moved:
        import_domain(model, ATEN_DOMAIN)
    return moved


def _pass(exported: Any, _options: Mapping[str, Any]) -> None:
    sigmoids_to_pytorch(exported.model)


# before the ATen pass (40), which prepares every ATen node for the engine
register_post_export_pass("sigmoid_tail", _pass, order=38)
