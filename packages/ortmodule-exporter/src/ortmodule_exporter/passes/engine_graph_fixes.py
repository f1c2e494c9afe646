"""Post-export rewrites of graph shapes the engine's gradient builder gets wrong.

* A Cast to the type its input already has (``x.float()`` on a float tensor, the cast a
  symbolic puts on a scalar argument): the engine's optimiser drops it, and when its input is a
  graph input the graph output or the input's gradient goes missing ("Graph output (output)
  does not exist", "failed to find NodeArg input_grad"). Its readers read its input instead;
  a graph output gets an Identity.
* A node reading the same graph input twice (``Mul(x, x)`` for ``torch.square``): the engine
  names both partial gradients ``x_grad`` ("Duplicate definition of name"). The second read
  goes through an Identity, so the two gradients are summed.
* ``ConcatFromSequence`` over a ``SequenceConstruct`` (``torch.vstack``/``hstack`` of a tuple):
  the engine's gradient stops at sequence values ("Cannot compute the partial derivative ...
  unreachable from the output"). It becomes ``Concat`` of the sequence's tensors, each through
  an ``Unsqueeze`` first when the node stacks (``new_axis=1``).

>>> from ortmodule_exporter import engine_graph_fixes
>>> engine_graph_fixes.fix_graph(model)  # done by a post-export pass
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

from .registry import register_post_export_pass

__all__ = ["fix_graph"]


def _types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


def _concat(node: onnx.NodeProto, members: list[str]) -> list[onnx.NodeProto]:
    """``node`` (a ConcatFromSequence over a sequence of ``members``) as Concat, with an
    Unsqueeze of each member first when it stacks along a new axis."""
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    new_axis = next((a.i for a in node.attribute if a.name == "new_axis"), 0)
    nodes: list[onnx.NodeProto] = []
    parts = members
    if new_axis:
        axes = f"{node.output[0]}__stack_axis"
        nodes.append(
            onnx.helper.make_node(
                "Constant",
                [],
                [axes],
                value=onnx.helper.make_tensor(axes, onnx.TensorProto.INT64, [1], [axis]),
            )
        )
        parts = [f"{node.output[0]}__stacked{i}" for i in range(len(members))]
        nodes.extend(
            onnx.helper.make_node("Unsqueeze", [m, axes], [p])
            for m, p in zip(members, parts, strict=True)
        )
    nodes.append(
        onnx.helper.make_node("Concat", parts, list(node.output), name=node.name, axis=axis)
    )
    return nodes


def fix_graph(model: onnx.ModelProto) -> int:
    """Apply the rewrites to ``model`` in place; returns how many nodes changed."""
    graph = model.graph
    types = _types(graph)
    inputs = {vi.name for vi in graph.input}
    outputs = {vi.name for vi in graph.output}
    sequences = {
        n.output[0]: list(n.input)
        for n in graph.node
        if n.op_type == "SequenceConstruct" and n.domain in ("", "ai.onnx") and n.input
    }
    changed = 0
    nodes: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name in renamed:
                node.input[slot] = renamed[name]
        if (
            node.op_type == "ConcatFromSequence"
            and node.domain in ("", "ai.onnx")
            and node.input[0] in sequences
        ):
            nodes.extend(_concat(node, sequences[node.input[0]]))
            changed += 1
            continue
        if node.domain in ("", "ai.onnx") and node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to is not None and types.get(node.input[0]) == to:
                changed += 1
                if node.output[0] in outputs:
                    nodes.append(
                        onnx.helper.make_node(
                            "Identity", [node.input[0]], list(node.output), name=node.name
                        )
                    )
                else:
                    renamed[node.output[0]] = node.input[0]
                continue
        seen: set[str] = set()
        for slot, name in enumerate(node.input):
            if name in inputs and name in seen:
                copy = f"{name}__read{changed}"
                nodes.append(onnx.helper.make_node("Identity", [name], [copy]))
                node.input[slot] = copy
                changed += 1
            seen.add(name)
        nodes.append(node)
    if changed:
        # a SequenceConstruct read by nothing now (every reader was a rewritten Concat) goes
        read = {name for n in nodes for name in n.input} | outputs
        nodes = [
            n for n in nodes if not (n.op_type == "SequenceConstruct" and n.output[0] not in read)
        ]
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _pass(exported: Any, _options: Mapping[str, Any]) -> None:
    fix_graph(exported.model)


register_post_export_pass("engine_graph_fixes", _pass, order=45)
