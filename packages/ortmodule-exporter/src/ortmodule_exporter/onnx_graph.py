"""Small, pure edits of ONNX graphs shared by the export and the post-export passes."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.shape_inference

# ONNX Runtime 1.19 reads models up to IR version 10; onnx >= 1.17 writes newer by default.
MAX_IR_VERSION = 10

#: ONNX element types that carry a gradient
FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    }
)


def cap_ir_version(model: onnx.ModelProto) -> None:
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name`` (strings decoded), or ``default``."""
    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def set_attribute(node: onnx.NodeProto, name: str, value: Any) -> None:
    """Give ``node`` the attribute ``name`` = ``value``, in place of any it had by that name."""
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, onnx.helper.make_attribute(name, value)])


def producers_and_consumers(
    graph: onnx.GraphProto,
) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """value name -> the node that writes it, and value name -> the nodes that read it."""
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return producers, consumers


def import_domain(model: onnx.ModelProto, domain: str, version: int = 1) -> None:
    """Add ``domain`` to the model's opset imports unless it is there (a pass that writes the
    first node of a custom domain: ATen, PythonOp)."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(domain, version))


def rename_value(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename a value everywhere in ``graph`` (node inputs and outputs, graph inputs/outputs)."""
    rename_values(graph, {old: new})


def rename_values(graph: onnx.GraphProto, renames: Mapping[str, str]) -> None:
    """Rename values everywhere in ``graph``, all at once, in one walk over it (a walk per
    value took 2 s for GPT-2 124M's 163 parameters). Renames are simultaneous: a new name that
    is also an old one is not renamed again."""
    renames = {old: new for old, new in renames.items() if old != new}
    if not renames:
        return
    for node in graph.node:
        for names in (node.input, node.output):
            for i, name in enumerate(names):
                new = renames.get(name)
                if new is not None:
                    names[i] = new
    for seq in (graph.input, graph.output, graph.value_info, graph.initializer):
        for item in seq:
            new = renames.get(item.name)
            if new is not None:
                item.name = new


def name_outputs(graph: onnx.GraphProto, names: list[str]) -> None:
    """Give the graph outputs the names in ``names``, position by position.

    An output that is also a graph input or appears twice gets an Identity node rather than a
    rename, so that no other value changes name.
    """
    if len(names) != len(graph.output):
        raise ValueError(f"{len(graph.output)} graph outputs but {len(names)} names")
    graph_inputs = {vi.name for vi in graph.input}
    seen: set[str] = set()
    renames: dict[str, str] = {}
    identities: list[onnx.NodeProto] = []
    for out, new in zip(graph.output, names, strict=True):
        old = out.name
        # what the value is called once the renames before it are made (an output that
        # appears twice was renamed at its first place)
        current = renames.get(old, old)
        if current == new:
            seen.add(new)
            continue
        if old in graph_inputs or current in seen:
            identities.append(
                onnx.helper.make_node("Identity", [current], [new], name=f"{new}_identity")
            )
            out.name = new
        else:
            renames[old] = new
        seen.add(new)
    # one walk over the graph for every rename (a walk per output took 0.18 s on GPT-2 124M)
    rename_values(graph, renames)
    graph.node.extend(identities)


def name_unnamed_nodes(graph: onnx.GraphProto) -> int:
    """Give every node of ``graph`` without a name a unique one (``<op_type>_unnamed<i>``);
    returns how many were named.

    Engine workaround: the memory optimizer names a recomputed node ``<name>_recompute``, so two
    recomputed nodes without a name made two ``_recompute`` nodes and the session refused the
    model ("two nodes with same node name", onnxruntime 1.19.2; the torch_export frontend and
    some of our passes write nodes without names)."""
    taken = {n.name for n in graph.node if n.name}
    counter = itertools.count()
    named = 0
    for node in graph.node:
        if node.name:
            continue
        candidate = f"{node.op_type}_unnamed{next(counter)}"
        while candidate in taken:
            candidate = f"{node.op_type}_unnamed{next(counter)}"
        node.name = candidate
        taken.add(candidate)
        named += 1
    return named


def make_dims_symbolic(vi: onnx.ValueInfoProto, prefix: str) -> None:
    """Replace every fixed dim of a value's declared shape by a named symbolic dim."""
    tensor_type = vi.type.tensor_type
    if not tensor_type.HasField("shape"):
        return
    for i, dim in enumerate(tensor_type.shape.dim):
        if not dim.HasField("dim_param"):
            dim.Clear()
            dim.dim_param = f"{prefix}_dim{i}"


def graph_input_names(model: onnx.ModelProto) -> list[str]:
    return [vi.name for vi in model.graph.input]


def graph_output_names(model: onnx.ModelProto) -> list[str]:
    return [vi.name for vi in model.graph.output]


def output_dependencies(model: onnx.ModelProto, outputs: list[str]) -> list[frozenset[str]]:
    """For each output, the graph inputs it is computed from (walking the graph backwards).

    One walk for all outputs: each value's inputs are found once, as a bit set over the graph
    inputs (a walk per output read the layers before it again: the guards of a 12-layer GPT-2,
    one per layer, walked the graph 65 times)."""
    producer = {name: node for node in model.graph.node for name in node.output if name}
    names = [vi.name for vi in model.graph.input]
    bit = {name: 1 << i for i, name in enumerate(names)}
    found: dict[str, int] = {}
    for out in outputs:
        stack = [out]
        entered: set[str] = set()
        while stack:
            name = stack[-1]
            if name in found:
                stack.pop()
                continue
            node = producer.get(name)
            if node is not None and name not in entered:
                entered.add(name)
                # a value on the current path (a cycle in a malformed graph) adds nothing
                stack.extend(i for i in node.input if i and i not in found and i not in entered)
                continue
            stack.pop()
            mask = bit.get(name, 0)
            if node is not None:
                for i in node.input:
                    if i:
                        mask |= found.get(i, 0)
            found[name] = mask
    return [
        frozenset(n for i, n in enumerate(names) if found[out] >> i & 1)
        if found[out]
        else frozenset()
        for out in outputs
    ]


#: ONNX's reductions: each takes ``axes`` that must lie in [-rank, rank - 1]
REDUCTIONS = frozenset(
    {
        *("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1"),
        *("ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"),
    }
)


def declared_types(model: onnx.ModelProto) -> dict[str, int]:
    """Value name -> ONNX element type, as the graph declares them (inputs, value_info,
    outputs, initializers), without inference."""
    return _elem_types(model.graph)


def _elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in (*graph.input, *graph.value_info, *graph.output)
        if vi.type.HasField("tensor_type")
    }
    types.update({init.name: init.data_type for init in graph.initializer})
    return types


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Value name -> ONNX element type, for every value whose type is declared or inferred.

    The export declares none for intermediate values; ONNX's shape inference finds those of
    standard operators (ATen and PythonOp outputs stay unknown). A graph it cannot read keeps
    the types it declares."""
    graph = model.graph
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - inference is best effort, declared types still hold
        pass
    # the element types alone: reading every dim too (value_shapes) took 0.1 s of GPT-2 small's
    # gradient build
    return {name: elem for name, elem in _elem_types(graph).items() if elem}


def differentiable_inputs(
    model: onnx.ModelProto,
    names: list[str],
    stop_edges: Callable[[onnx.NodeProto], Collection[int]] = lambda node: (),
) -> set[str]:
    """Those of ``names`` (graph inputs) that some floating-point graph output is computed from
    through floating-point values only: the ones a gradient can reach. A path through an integer
    or bool value (TopK's indices, a comparison, a Shape) carries no gradient, in PyTorch as in
    the engine, nor does one through an input the engine never differentiates: a
    BatchNormalization's running mean and variance (the stop-gradient copy of
    ``symbolics.helpers._stop_gradient``), or an input of a node that ``stop_edges(node)``
    names. A value of unknown type counts as floating point, and a node with subgraphs (If,
    Loop) reads every value its subgraphs name."""
    graph = model.graph
    types = value_types(model)

    def carries(name: str) -> bool:
        return bool(name) and types.get(name, onnx.TensorProto.FLOAT) in FLOAT_TYPES

    producer = {name: node for node in graph.node for name in node.output if name}
    stack = [vi.name for vi in graph.output if carries(vi.name)]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            blocked = set(stop_edges(node))
            if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
                blocked |= {3, 4}
            inputs = [i for k, i in enumerate(node.input) if k not in blocked]
            stack.extend(i for i in (*inputs, *_subgraph_reads(node)) if carries(i))
    return {name for name in names if name in seen}


def _subgraph_reads(node: onnx.NodeProto) -> list[str]:
    """Every value name read inside ``node``'s subgraph attributes (outer-scope reads among them)."""
    reads: list[str] = []
    for a in node.attribute:
        graphs = [a.g] if a.HasField("g") else list(a.graphs)
        for g in graphs:
            for inner in g.node:
                reads.extend(i for i in inner.input if i)
                reads.extend(_subgraph_reads(inner))
    return reads


# an exported node's name is its module scope then the operator: /_ortmodule_wrapped/model/
# layers.0/self_attn/CumSum_3 (the prefix is the exporter's wrapper attribute)
_NODE_NAME = re.compile(
    r"(/_ortmodule_wrapped/((?:[^/\s()']+/)*)([A-Za-z]+)(?:_\d+)?)(?=[)'\s:]|$)"
)
_NAMED_NODE = re.compile(r"[Nn]ode \(?'?" + _NODE_NAME.pattern)


def node_location(
    message: str,
    graph: onnx.GraphProto | None = None,
    describe: Callable[[onnx.NodeProto], str] | None = None,
) -> str:
    """`` at operator CumSum in model.layers.0.self_attn`` for the first exported node named in
    an engine error message, or ``""`` when it names none. ``describe(node)``, given the
    ``graph`` the message is about, adds to the operator's name (the engine's ATen nodes name
    the PyTorch operator they run: `` at operator ATen (aten::_grouped_mm.default) in ...``)."""
    m = _NAMED_NODE.search(message) or _NODE_NAME.search(message)
    if m is None:
        return ""
    path = m.group(2).strip("/").replace("/", ".")
    node = None
    if graph is not None and describe is not None:
        node = next((n for n in graph.node if n.name == m.group(1)), None)
    detail = describe(node) if node is not None and describe is not None else ""
    return f" at operator {m.group(3)}{detail} in {path or 'the module itself'}"


def value_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, list[int | None] | None]]:
    """Value name -> (element type, dims) for every typed graph input, ``value_info``, output and
    initializer of ``graph``; a dim without a fixed size is None, dims are None without a shape."""
    known: dict[str, tuple[int, list[int | None] | None]] = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not t.elem_type:
            continue
        dims = None
        if t.HasField("shape"):
            dims = [int(d.dim_value) if d.HasField("dim_value") else None for d in t.shape.dim]
        known[vi.name] = (t.elem_type, dims)
    for init in graph.initializer:
        known[init.name] = (init.data_type, list(init.dims))
    return known


def inferred_value_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None] | None]]:
    """:func:`value_shapes` of ``model`` after ONNX shape inference (not strict; the declared
    types alone where inference fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - types are found best effort
        inferred = model
    return value_shapes(inferred.graph)


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Value name -> array for every initializer and numeric ``Constant`` node output of
    ``graph`` (``value_float(s)`` as float32, ``value_int(s)`` as int64, as ONNX declares them)."""
    found = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    # a string constant (an ATen node's ``rounding_mode``) has no array
                    found[node.output[0]] = onnx.numpy_helper.to_array(a.t)
                elif a.name in ("value_float", "value_int", "value_floats", "value_ints"):
                    dtype = np.float32 if a.name.startswith("value_float") else np.int64
                    found[node.output[0]] = np.array(onnx.helper.get_attribute_value(a), dtype)
    return found


def evaluate_constants(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    """Value name -> array for each of ``names`` computed from no graph input, found by running
    the nodes that compute it with ONNX's reference evaluator; a value whose nodes it cannot run
    (an operator of another domain, say) is left out.

    >>> evaluate_constants(model, ["output.1"])  # doctest: +SKIP
    {'output.1': array(0)}
    """
    from onnx.reference import ReferenceEvaluator  # noqa: PLC0415 - rarely needed, slow import

    graph = model.graph
    producer = {o: k for k, node in enumerate(graph.node) for o in node.output if o}
    found: dict[str, np.ndarray] = {}
    for name in names:
        needed: set[int] = set()
        stack = [producer[name]] if name in producer else []
        while stack:
            k = stack.pop()
            if k in needed:
                continue
            needed.add(k)
            node = graph.node[k]
            stack.extend(
                producer[i] for i in (*node.input, *_subgraph_reads(node)) if i in producer
            )
        sub = onnx.helper.make_model(
            onnx.helper.make_graph(
                [graph.node[k] for k in sorted(needed)],
                "constants",
                [],
                [onnx.helper.make_empty_tensor_value_info(name)],
                list(graph.initializer),
            ),
            opset_imports=list(model.opset_import),
            functions=list(model.functions),
        )
        try:
            (value,) = ReferenceEvaluator(sub).run(None, {})
        except Exception:  # noqa: BLE001 - what cannot be evaluated is left out
            continue
        found[name] = np.asarray(value)
    return found
