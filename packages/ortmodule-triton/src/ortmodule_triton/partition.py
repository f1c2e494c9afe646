"""Find the fusible subgraphs of a graph and cut them out as standalone ONNX models.

Nodes the config allows (op, version, domain, conditions) are grouped greedily in topological
order: a node joins the groups of its producers when the merged group stays acyclic (no path
leaves the group and comes back) and the code generator accepts it. Groups with fewer than
``min_nodes`` counted nodes (``is_no_op`` ops do not count) are dropped.

>>> # groups = find_subgraphs(model, FusionConfig.default())
>>> # for g in groups: g.model  (inputs: g.inputs, outputs: g.outputs, in the graph's names)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.defs
import onnx.numpy_helper
import onnx.shape_inference

from ortmodule_exporter.onnx_graph import constant_values

from .codegen import META_INPUTS, generate
from .errors import TritonCodegenError
from .fusion_config import FusionConfig, OpRule, since_version

__all__ = ["Subgraph", "find_subgraphs", "replace_subgraphs", "topological_sort"]

TypeInfo = tuple[int, list[int | str | None] | None]


@dataclass(frozen=True)
class Subgraph:
    """One fusible group: its nodes (indices into the graph), and the model cut out of it."""

    nodes: tuple[int, ...]
    model: onnx.ModelProto
    #: names in the big graph, in the subgraph model's input/output order
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def _types(model: onnx.ModelProto) -> dict[str, TypeInfo]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - shapes are best effort; unknown ranks are not fused
        inferred = model
    found: dict[str, TypeInfo] = {}
    g = inferred.graph
    for vi in (*g.input, *g.value_info, *g.output):
        t = vi.type.tensor_type
        if not t.elem_type:
            continue
        dims: list[int | str | None] | None = None
        if t.HasField("shape"):
            dims = [
                int(d.dim_value)
                if d.HasField("dim_value")
                else (d.dim_param if d.HasField("dim_param") else None)
                for d in t.shape.dim
            ]
        found[vi.name] = (t.elem_type, dims)
    for init in g.initializer:
        found[init.name] = (init.data_type, list(init.dims))
    return found


def _input_index(node: onnx.NodeProto, name: str, opset: int) -> int | None:
    if node.domain not in ("", "ai.onnx"):
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    for i, formal in enumerate(schema.inputs):
        if formal.name == name:
            return i
    return None


def _condition_holds(
    node: onnx.NodeProto, key: str, want: str, consts: Mapping[str, np.ndarray], opset: int
) -> bool:
    value: object = None
    is_constant = True
    attrs = {a.name: a for a in node.attribute}
    if key in attrs:
        value = onnx.helper.get_attribute_value(attrs[key])
    else:
        index = _input_index(node, key, opset)
        if index is None or index >= len(node.input) or not node.input[index]:
            return False
        name = node.input[index]
        if name in consts:
            value = consts[name].tolist()
        else:
            is_constant = False
    if want == "constant":
        return is_constant and value is not None
    if not is_constant or value is None:
        return False
    if want == "single":
        return not isinstance(value, list) or len(value) == 1
    expected = json.loads(want)
    if isinstance(value, bytes):
        value = value.decode()
    return bool(value == expected)


def _allowed(
    node: onnx.NodeProto,
    rule: OpRule | None,
    opsets: Mapping[str, int],
    consts: Mapping[str, np.ndarray],
    types: Mapping[str, TypeInfo],
) -> bool:
    if rule is None:
        return False
    if rule.versions is not None and since_version(node, opsets) not in rule.versions:
        return False
    opset = opsets.get("", 17)
    if not all(_condition_holds(node, k, v, consts, opset) for k, v in rule.conditions.items()):
        return False
    for name in (*node.input, *node.output):
        if name and name not in consts and (name not in types or types[name][1] is None):
            return False  # the code generator needs every rank
    return True


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorder ``graph.node`` so every node follows its producers (stable otherwise)."""
    produced_by: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                produced_by[out] = i
    nodes = list(graph.node)
    deps = [
        {produced_by[i] for i in node.input if i in produced_by and produced_by[i] != k}
        for k, node in enumerate(nodes)
    ]
    done: set[int] = set()
    order: list[int] = []
    remaining = list(range(len(nodes)))
    while remaining:
        progressed = False
        rest = []
        for k in remaining:
            if deps[k] <= done:
                order.append(k)
                done.add(k)
                progressed = True
            else:
                rest.append(k)
        if not progressed:
            raise TritonCodegenError("the graph has a cycle after fusing Triton subgraphs")
        remaining = rest
    del graph.node[:]
    graph.node.extend(nodes[k] for k in order)


def _value_info(name: str, info: TypeInfo) -> onnx.ValueInfoProto:
    elem, dims = info
    return onnx.helper.make_tensor_value_info(name, elem, dims)


def extract(
    model: onnx.ModelProto,
    members: Sequence[int],
    config: FusionConfig,
    types: Mapping[str, TypeInfo],
    consts: Mapping[str, np.ndarray],
    consumers: Mapping[str, list[int]],
    graph_outputs: set[str],
) -> Subgraph:
    """The standalone model of the nodes ``members`` (indices into ``model.graph.node``)."""
    nodes = [model.graph.node[k] for k in sorted(members)]
    member_set = set(members)
    produced = {o for n in nodes for o in n.output if o}
    inputs: list[str] = []
    initializers: list[onnx.TensorProto] = []
    for node in nodes:
        for position, name in enumerate(node.input):
            if not name or name in produced or name in inputs:
                continue
            if any(t.name == name for t in initializers):
                continue
            arr = consts.get(name)
            # axes are attributes in disguise: always embedded, whatever the initializer policy
            axes = META_INPUTS.get(node.op_type, -1) == position
            embed = arr is not None and (
                axes
                or config.initializer == "all"
                or (config.initializer == "scalar" and arr.size == 1)
            )
            if embed:
                assert arr is not None
                initializers.append(onnx.numpy_helper.from_array(arr, name))
            else:
                inputs.append(name)
    outputs = [
        o
        for n in nodes
        for o in n.output
        if o and (o in graph_outputs or any(c not in member_set for c in consumers.get(o, [])))
    ]
    graph = onnx.helper.make_graph(
        [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes],
        "triton_subgraph",
        [_value_info(i, types[i]) for i in inputs],
        [_value_info(o, types[o]) for o in outputs],
        initializer=initializers,
    )
    sub = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    return Subgraph(tuple(sorted(members)), sub, tuple(inputs), tuple(outputs))


def _codegen_accepts(sub: Subgraph) -> bool:
    if not sub.inputs or not sub.outputs:
        return False
    try:
        generate(sub.model)
    except (TritonCodegenError, NotImplementedError):
        return False
    return True


def find_subgraphs(
    model: onnx.ModelProto,
    config: FusionConfig,
    accept: Callable[[Subgraph], bool] | None = None,
    allow: Callable[[onnx.NodeProto], bool] | None = None,
) -> list[Subgraph]:
    """The fusible groups of ``model`` under ``config``.

    ``accept`` adds a check on a candidate group (the verification route also needs its
    gradient kernel); ``allow`` filters nodes further.
    """
    graph = model.graph
    types = _types(model)
    consts = constant_values(model.graph)
    opsets = {
        ("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in model.opset_import
    }
    consumers: dict[str, list[int]] = {}
    producer: dict[str, int] = {}
    for k, node in enumerate(graph.node):
        for i in node.input:
            consumers.setdefault(i, []).append(k)
        for o in node.output:
            producer[o] = k
    graph_outputs = {o.name for o in graph.output}
    group_of: dict[int, int] = {}
    groups: dict[int, set[int]] = {}

    def acyclic(members: set[int]) -> bool:
        # walk forward from the group's outside consumers through outside nodes only
        todo = [
            c
            for k in members
            for o in graph.node[k].output
            for c in consumers.get(o, [])
            if c not in members
        ]
        seen: set[int] = set()
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            # another group becomes one node: reaching any of its nodes reaches all of them
            if k in group_of and group_of[k] in groups:
                todo.extend(m for m in groups[group_of[k]] if m not in seen)
            for o in graph.node[k].output:
                for c in consumers.get(o, []):
                    if c in members:
                        return False
                    todo.append(c)
        return True

    def ok(members: set[int]) -> bool:
        if not acyclic(members):
            return False
        sub = extract(model, sorted(members), config, types, consts, consumers, graph_outputs)
        return _codegen_accepts(sub) and (accept is None or accept(sub))

    next_id = 0
    for k, node in enumerate(graph.node):
        if node.op_type == "Constant" or not _allowed(
            node, config.rule(node), opsets, consts, types
        ):
            continue
        if allow is not None and not allow(node):
            continue
        producers = sorted(
            {
                group_of[producer[i]]
                for i in node.input
                if i in producer and producer[i] in group_of
            },
            key=lambda g: -len(groups[g]),
        )
        choices = [producers] + [[g] for g in producers] if producers else []
        placed = False
        for choice in [*choices, []]:
            members = {k}.union(*(groups[g] for g in choice)) if choice else {k}
            if ok(members):
                gid = next_id
                next_id += 1
                for g in choice:
                    del groups[g]
                groups[gid] = members
                for m in members:
                    group_of[m] = gid
                placed = True
                break
        if not placed:
            continue

    found = []
    for members in groups.values():
        counted = [graph.node[m] for m in members if not _is_no_op(config, graph.node[m])]
        ignore = any(
            (r := config.rule(graph.node[m])) is not None and r.ignore_min_nodes for m in members
        )
        if len(counted) < config.min_nodes and not ignore:
            continue
        found.append(
            extract(model, sorted(members), config, types, consts, consumers, graph_outputs)
        )
    return sorted(found, key=lambda s: s.nodes)


def _is_no_op(config: FusionConfig, node: onnx.NodeProto) -> bool:
    rule = config.rule(node)
    return rule is not None and rule.is_no_op


def replace_subgraphs(
    model: onnx.ModelProto,
    subgraphs: Sequence[Subgraph],
    make_nodes: Callable[[Subgraph, int], list[onnx.NodeProto]],
) -> None:
    """Remove each subgraph's nodes and put ``make_nodes(subgraph, index)`` in their place."""
    graph = model.graph
    drop = {k for s in subgraphs for k in s.nodes}
    kept = [n for k, n in enumerate(graph.node) if k not in drop]
    added = [n for i, s in enumerate(subgraphs) for n in make_nodes(s, i)]
    used = {i for n in kept + added for i in n.input} | {o.name for o in graph.output}
    # Constant nodes whose only readers were fused are embedded in the kernels now
    kept = [n for n in kept if n.op_type != "Constant" or any(o in used for o in n.output)]
    del graph.node[:]
    graph.node.extend(kept + added)
    topological_sort(graph)
