"""Post-export rewrites of graph shapes the engine's gradient builder gets wrong.

* A Cast to the type its input already has (``x.float()`` on a float tensor, the cast a
  symbolic puts on a scalar argument): the engine's optimiser drops it, and when its input is a
  graph input the graph output or the input's gradient goes missing ("Graph output (output)
  does not exist", "failed to find NodeArg input_grad"), and when one node reads its output
  twice (``y = h.float(); y * y``) dropping it fails ("Argument mismatch when removing edge").
  Its readers read its input instead; a graph output gets an Identity. Types come from ONNX's
  shape inference where the export declares none (any value after a Reshape, say).
* A node reading the same graph input twice (``Mul(x, x)`` for ``torch.square``): the engine
  names both partial gradients ``x_grad`` ("Duplicate definition of name"). The second read
  goes through an Identity, so the two gradients are summed.
* Two or more ``LayerNormalization`` nodes normalising one tensor (two layer norms of ``x``,
  or of its centred copies ``x - mean(x)``, which the engine's own common-subexpression pass
  merges into one): the engine's LayerNormalizationGrad names each node's input gradient
  ``x_grad`` even where ``x`` takes none, and two of them fail the build ("Duplicate
  definition of name", 1.19.2). The k-th such node reads its input through a chain of k
  Identities, which no merge can make equal to another's.
* ``ConcatFromSequence`` over a ``SequenceConstruct`` (``torch.vstack``/``hstack`` of a tuple):
  the engine's gradient stops at sequence values ("Cannot compute the partial derivative ...
  unreachable from the output"). It becomes ``Concat`` of the sequence's tensors, each through
  an ``Unsqueeze`` first when the node stacks (``new_axis=1``).
* ``Div(1, d)`` read by one ``Mul`` (``torch.linspace(a, a + 1, t.shape[-1])`` exports its
  step as ``(end - start) / (steps - 1)``, which is ``1 / (steps - 1)``): the engine's
  pre-gradient rewrite ``DivMulFusion`` (``1 / d * x -> x / d``) leaves the graph broken and
  the process dies with a segmentation fault while the gradient graph is built (1.19.2; the
  numerator may be any constant expression, the engine folds it to 1 first). The Div becomes
  ``Reciprocal(d)``: the same number up to the last bit (the engine's CPU Reciprocal was
  within one ulp of ``1 / d`` in the tests, 2026-11-26).
* A graph output that a ``Gather`` or ``Slice`` reads, directly or through other nodes
  (``t = x.transpose(0, 1); return t[1] * w, t``, or ``t = x @ w; return (t + 1)[1], t``):
  the engine's compute optimiser moves the Gather up above the node that makes the output
  (gathering that node's input first), and the graph output comes back gathered, (1, 6) for
  (4, 6), without an error (1.19.2; found by the differential fuzzer, seed 9091; above a
  MatMul with a Slice the build crashed instead). The graph output becomes an ``Identity`` of
  the value, which the optimiser does not move past. The Identity copies the output once a
  step; an output no Gather or Slice reads (GPT-2's logits, read by the loss) keeps none, and
  so does one above a value with another reader, where the optimiser stopped in the tests
  (``u = t + 1`` read by the Gather and by a Mul: ``t`` came back whole).
* A ``Gather`` at a constant scalar index whose value has two readers, or two such Gathers
  of one value at one index (``torch.zeros_like(t.select(3, 0)) + t.select(3, 0)`` with
  ``t = a @ b``): the engine's compute optimiser moves the rank-dropping Gather above the
  MatMul with an Unsqueeze before and a Squeeze after, then hands one reader the squeezed value
  and the other the unsqueezed one; the result came back (2, 2, 1, 1) for (2, 1, 1), with
  wrong gradients and no error (1.19.2; fuzz seed 42065). The Gather keeps the axis (a
  one-element index) and a ``Squeeze`` follows it, which needs no adaptor.
* ``ReduceLogSumExp`` with ``keepdims=0`` and its axes as an attribute (opsets below 18:
  ``torch.logsumexp(x, dim)``): the engine's gradient puts the reduced axes back with an
  ``Unsqueeze`` carrying an ``axes`` attribute, which Unsqueeze lost in opset 13 ("Unsqueeze
  ... has input size 1 not in range [min=2, max=2]", 1.19.2). The node keeps its dims and a
  ``Squeeze`` of the same axes follows: the same values, and a gradient with no Unsqueeze.

>>> from ortmodule_exporter import engine_graph_fixes
>>> engine_graph_fixes.fix_graph(model)  # done by a post-export pass
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
from onnx.reference import ReferenceEvaluator

from ..onnx_graph import constant_values, producers_and_consumers, value_types
from .registry import register_post_export_pass

__all__ = ["fix_graph"]


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


#: float element types Reciprocal takes (an integer ``1 / d`` is left alone)
_RECIPROCAL_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
#: the most nodes a constant expression may have for :func:`_constant_values` to evaluate it
_MAX_CONSTANT_NODES = 32


def _constant_values(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    """The values of those of ``names`` that only Constant nodes and initializers decide (the
    engine's constant folding computes them before its rewrites run)."""
    graph = model.graph
    producer = {out: n for n in graph.node for out in n.output}
    initializers = {t.name: t for t in graph.initializer}
    inputs = {vi.name for vi in graph.input}
    values: dict[str, np.ndarray] = {}
    for name in names:
        if name in initializers and name not in inputs:
            values[name] = onnx.numpy_helper.to_array(initializers[name])
            continue
        needed: list[onnx.NodeProto] = []
        used: set[str] = set()
        todo, seen, constant = [name], set(), True
        while todo and constant:
            value = todo.pop()
            if value in seen:
                continue
            seen.add(value)
            if value in initializers and value not in inputs:
                used.add(value)
            elif value in producer and producer[value].domain in ("", "ai.onnx"):
                node = producer[value]
                needed.append(node)
                todo.extend(i for i in node.input if i)
                constant = len(needed) <= _MAX_CONSTANT_NODES and not any(
                    a.type == onnx.AttributeProto.GRAPH for a in node.attribute
                )
            else:
                constant = False  # a graph input, a custom op or a missing value
        if not constant:
            continue
        order = [n for n in graph.node if any(n is m for m in needed)]
        small = onnx.helper.make_graph(
            order,
            "constant",
            [],
            [onnx.helper.make_empty_tensor_value_info(name)],
            [initializers[u] for u in sorted(used)],
        )
        sub = onnx.helper.make_model(small, opset_imports=model.opset_import)
        try:
            computed: Any = ReferenceEvaluator(sub).run(None, {})
            values[name] = np.asarray(computed[0])
        except Exception:  # noqa: BLE001 -- an expression we cannot evaluate is not rewritten
            continue
    return values


def _unit_reciprocals(model: onnx.ModelProto) -> int:
    """``Div(1, d)`` read by exactly one ``Mul`` becomes ``Reciprocal(d)`` (``Mul(one,
    Reciprocal(d))`` when the 1 has dimensions, to keep the broadcast shape)."""
    graph = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in set(n.input):
            readers.setdefault(name, []).append(n)
    outputs = {vi.name for vi in graph.output}
    divs = [
        n
        for n in graph.node
        if n.op_type == "Div"
        and n.domain in ("", "ai.onnx")
        and n.output[0] not in outputs
        and [r.op_type for r in readers.get(n.output[0], [])] == ["Mul"]
    ]
    if not divs:
        return 0
    values = _constant_values(model, [n.input[0] for n in divs])
    changed = 0
    nodes: list[onnx.NodeProto] = []
    rewrite = {}
    for div in divs:
        value = values.get(div.input[0])
        if (
            value is None
            or value.size != 1
            or onnx.helper.np_dtype_to_tensor_dtype(value.dtype) not in _RECIPROCAL_TYPES
            or value.reshape(()).item() != 1.0
        ):
            continue
        if value.ndim == 0:
            rewrite[id(div)] = [
                onnx.helper.make_node("Reciprocal", [div.input[1]], list(div.output), name=div.name)
            ]
        else:
            inverse = f"{div.output[0]}__reciprocal"
            rewrite[id(div)] = [
                onnx.helper.make_node("Reciprocal", [div.input[1]], [inverse], name=div.name),
                onnx.helper.make_node("Mul", [div.input[0], inverse], list(div.output)),
            ]
    for n in graph.node:
        if id(n) in rewrite:
            nodes.extend(rewrite[id(n)])
            changed += 1
        else:
            nodes.append(n)
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _kept_dims_logsumexp(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """``node`` as a ReduceLogSumExp with ``keepdims=1`` and a Squeeze of its axes, when it is
    one with ``keepdims=0`` and attribute axes (None otherwise)."""
    keepdims = next((a for a in node.attribute if a.name == "keepdims"), None)
    if (
        node.op_type != "ReduceLogSumExp"
        or node.domain not in ("", "ai.onnx")
        or keepdims is None
        or keepdims.i != 0
        or len(node.input) > 1  # axes as an input (opset 18+): the engine's gradient is right
    ):
        return None
    kept = f"{node.output[0]}__kept_dims"
    keepdims.i = 1
    reduce = onnx.helper.make_node(node.op_type, list(node.input), [kept], name=node.name)
    reduce.attribute.extend(node.attribute)
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None:  # every axis reduced: every dim is 1 now, Squeeze drops them all
        return [reduce, onnx.helper.make_node("Squeeze", [kept], list(node.output))]
    name = f"{node.output[0]}__squeezed_axes"
    return [
        reduce,
        onnx.helper.make_node(
            "Constant",
            [],
            [name],
            value=onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [len(axes)], axes),
        ),
        onnx.helper.make_node("Squeeze", [kept, name], list(node.output)),
    ]


def _normalised_source(name: str, producer: Mapping[str, onnx.NodeProto]) -> str:
    """The tensor a LayerNormalization input normalises: ``x`` for ``x - ReduceMean(x)`` (a
    centred float32 layer norm, ``symbolics.normalization``), else the input itself."""
    sub = producer.get(name)
    if sub is None or sub.op_type != "Sub" or len(sub.input) != 2:
        return name
    mean = producer.get(sub.input[1])
    if mean is not None and mean.op_type == "ReduceMean" and mean.input[0] == sub.input[0]:
        return sub.input[0]
    return name


_GATHERS = frozenset({"Gather", "Slice"})


def _above_gathers(graph: onnx.GraphProto) -> set[str]:
    """Values the engine may move a Gather or Slice above: the one it reads, and upward from
    there through each producer while the value passed through has no other reader (where one
    has, the optimiser stops: a Llama's rotary Slice does not reach the layers before it)."""
    producer, consumers = producers_and_consumers(graph)
    todo = [n.input[0] for n in graph.node if n.op_type in _GATHERS and n.input]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None and _reading_nodes(consumers, name) == 1:
            todo.extend(i for i in node.input if i)
    return seen


def _reading_nodes(consumers: Mapping[str, list[onnx.NodeProto]], name: str) -> int:
    """How many nodes read ``name`` (a node reading it twice counts once)."""
    return len({id(n) for n in consumers.get(name, [])})


def _read_gathers_keep_their_axis(graph: onnx.GraphProto) -> int:
    """Each ``Gather`` at a constant scalar index whose value is read more than once (by two
    nodes, or by two such Gathers of one value at one index, which the engine's
    common-subexpression pass merges) gathers at a one-element index and a ``Squeeze`` drops
    the axis after it. The engine's compute optimiser moves a rank-dropping Gather above the
    node it reads (a MatMul, say) with an Unsqueeze before and a Squeeze after, then gives only
    one reader the squeezed value and another the unsqueezed one:
    ``torch.zeros_like(t.select(3, 0)) + t.select(3, 0)`` with ``t = a @ b`` came back of shape
    (2, 2, 1, 1) for (2, 1, 1), with wrong gradients and no error (1.19.2; fuzz seed 42065).
    A Gather that keeps its axis needs no adaptor."""
    scalars = {name: v for name, v in constant_values(graph).items() if v.ndim == 0}
    _producer, consumers = producers_and_consumers(graph)
    outputs = {vi.name for vi in graph.output}

    def readers(name: str) -> int:
        return _reading_nodes(consumers, name) + (name in outputs)

    groups: dict[tuple[str, int, Any], list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        index = scalars.get(node.input[1])
        if index is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        groups.setdefault((node.input[0], axis, index.item()), []).append(node)
    #: id of a rewritten Gather -> the nodes around it (index constant and axes before, the
    #: Squeeze after)
    around: dict[int, tuple[list[onnx.NodeProto], list[onnx.NodeProto]]] = {}
    for (_data, axis, _index), gathers in groups.items():
        if sum(readers(g.output[0]) for g in gathers) < 2:
            continue
        for node in gathers:
            tag = f"{node.output[0]}__kept_axis"
            before = [
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [f"{tag}_index"],
                    value=onnx.numpy_helper.from_array(
                        scalars[node.input[1]].reshape(1), f"{tag}_index_value"
                    ),
                ),
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [f"{tag}_axes"],
                    value=onnx.numpy_helper.from_array(np.array([axis], np.int64), f"{tag}_ax"),
                ),
            ]
            after = [onnx.helper.make_node("Squeeze", [tag, f"{tag}_axes"], [node.output[0]])]
            node.input[1], node.output[0] = f"{tag}_index", tag
            around[id(node)] = (before, after)
    if around:
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            before, after = around.get(id(node), ([], []))
            nodes.extend([*before, node, *after])
        del graph.node[:]
        graph.node.extend(nodes)
    return len(around)


def fix_graph(model: onnx.ModelProto) -> int:
    """Apply the rewrites to ``model`` in place; returns how many nodes changed."""
    rewritten_first = _unit_reciprocals(model) + _read_gathers_keep_their_axis(model.graph)
    graph = model.graph
    # inferred too: a Cast after a Reshape has an input of no declared type
    types = value_types(model)
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
    #: the tensor each LayerNormalization normalises -> how many did so far
    layer_norms: dict[str, int] = {}
    producer = {o: n for n in graph.node for o in n.output}
    under_gathers = _above_gathers(graph)
    typed_values = {
        vi.name: vi for vi in (*graph.value_info, *graph.output) if vi.type.tensor_type.elem_type
    }
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
        logsumexp = _kept_dims_logsumexp(node)
        if logsumexp is not None:
            nodes.extend(logsumexp)
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
        gathered = [o for o in node.output if o in outputs and o in under_gathers]
        if gathered:
            for slot, name in enumerate(node.output):
                if name in gathered:
                    node.output[slot] = renamed[name] = f"{name}__returned"
                    # the engine infers no type through an ATen node (a sigmoid's output
                    # returned and read by a reduction: "type inference failed"): the new
                    # name carries the output's declared one
                    typed = typed_values.get(name)
                    if typed is not None:
                        kept = onnx.ValueInfoProto()
                        kept.CopyFrom(typed)
                        kept.name = renamed[name]
                        graph.value_info.append(kept)
            nodes.append(node)
            nodes.extend(onnx.helper.make_node("Identity", [renamed[o]], [o]) for o in gathered)
            changed += len(gathered)
            continue
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            source = _normalised_source(node.input[0], producer)
            depth = layer_norms.get(source, 0)
            layer_norms[source] = depth + 1
            for _ in range(depth):
                copy = f"{node.input[0]}__read{changed}"
                nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [copy]))
                node.input[0] = copy
                changed += 1
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
    return changed + rewritten_first


def _pass(exported: Any, _options: Mapping[str, Any]) -> None:
    fix_graph(exported.model)


register_post_export_pass("engine_graph_fixes", _pass, order=45)
