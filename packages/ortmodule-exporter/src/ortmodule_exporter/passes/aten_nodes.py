"""The post-export pass over ATen nodes (order 40): make every ``org.pytorch.aten`` node of an
exported model runnable by the engine's ATen executor and trainable.

See :func:`prepare_aten_nodes`; which operators become ATen nodes is decided at export time by
:mod:`ortmodule_exporter.aten.routes`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch

from ..aten import executor as aten_executor
from ..aten.aten_op import AtenOp
from ..aten.executor import ATEN_DOMAIN
from ..aten.gradients import has_gradient
from ..aten.routes import EINSUM
from ..aten.untrainable import TRACED_TYPES
from ..onnx_graph import (
    FLOAT_TYPES,
    attribute,
    constant_values,
    import_domain,
    inferred_value_shapes,
    value_shapes,
)
from ..python_op import runner as python_op_runner
from ..python_op.registry import PYTHON_OP_DOMAIN, REGISTRY, python_op_node
from .registry import register_post_export_pass

logger = logging.getLogger("ortmodule.exporter")

# -- the post-export pass over ATen nodes -------------------------------------------------------------

__all__ = ["prepare_aten_nodes"]


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = a.t.data_type
    return types


def _output_types(
    node: onnx.NodeProto,
    known: Mapping[str, tuple[int, list[int | None] | None]],
    constants: Mapping[str, np.ndarray],
    strings: Mapping[str, str] | None = None,
    sequences: Mapping[str, list[str]] | None = None,
) -> list[tuple[int, int | None]] | None:
    """(elem_type, rank) of each output of an ATen node, found by running its operator on
    PyTorch's meta device (no data, no compute); None when that is not possible."""
    from onnx.helper import tensor_dtype_to_np_dtype

    operator = attribute(node, "operator", "")
    overload = attribute(node, "overload_name", "") or ""
    strings = strings or {}
    sequences = sequences or {}

    # an input whose rank nothing knows runs as a vector: the outputs' ranks then say nothing
    # (an elementwise sigmoid of a 3-d tensor was declared 1-d, and the engine's build failed
    # at the Transpose reading it), so only their element types are declared
    guessed_rank = False

    def meta(name: str) -> torch.Tensor | None:
        nonlocal guessed_rank
        if name in constants:
            return torch.from_numpy(np.array(constants[name]))
        if name in known:
            elem_type, dims = known[name]
            dtype = torch.from_numpy(np.zeros(0, dtype=tensor_dtype_to_np_dtype(elem_type))).dtype
            guessed_rank = guessed_rank or dims is None
            shape = [d if d else 2 for d in dims] if dims is not None else [2]
            return torch.empty(shape, dtype=dtype, device="meta")
        return None

    inputs: list[Any] = []
    for name in node.input:
        if not name:
            inputs.append(None)
        elif name in strings:
            inputs.append(strings[name])
        elif name in sequences:
            members = [meta(m) for m in sequences[name]]
            if any(m is None for m in members):
                return None
            inputs.append(members)
        else:
            value = meta(name)
            if value is None:
                return None
            inputs.append(value)
    try:
        with torch.no_grad():
            results = aten_executor.execute(operator, overload, inputs)
    except Exception:  # noqa: BLE001
        return None
    types: list[tuple[int, int | None]] = []
    for r in results:
        if r is None:
            types.append((onnx.TensorProto.FLOAT, None))
            continue
        np_dtype = torch.empty(0, dtype=r.dtype).numpy().dtype
        rank = None if guessed_rank else r.dim()
        types.append((onnx.helper.np_dtype_to_tensor_dtype(np_dtype), rank))
    return types


#: operator names whose output sizes depend on the input's values that PyTorch's
#: ``dynamic_output_shape`` tag does not cover (:func:`data_dependent_sizes`): ``unique`` is
#: ``torch.unique``'s name, which has no ATen operator of its own (``nonzero``, ``_unique2``,
#: ``masked_select``, ``bincount``, ``repeat_interleave``, ... carry the tag)
DATA_DEPENDENT_SIZES = frozenset({"unique"})


@functools.cache
def data_dependent_sizes(operator: str) -> bool:
    """Whether ATen ``operator``'s output sizes may depend on its inputs' values (a traced size
    of theirs is never taken for a fixed one, :func:`_fix_static_sizes`): an overload of it
    carries PyTorch's ``dynamic_output_shape`` tag (``nonzero``, ``index`` with a boolean mask,
    ``one_hot`` without ``num_classes``, any operator PyTorch tags later), or it is named in
    :data:`DATA_DEPENDENT_SIZES`.

    >>> data_dependent_sizes("index"), data_dependent_sizes("softplus")
    (True, False)
    """
    if operator in DATA_DEPENDENT_SIZES:
        return True
    packet = getattr(torch.ops.aten, operator, None) if operator.isidentifier() else None
    if packet is None or not hasattr(packet, "overloads"):
        return False
    return any(
        torch.Tag.dynamic_output_shape in getattr(packet, overload).tags
        for overload in packet.overloads()
    )


def _declare_traced_types(graph: onnx.GraphProto) -> None:
    """Declare the types the export recorded on ATen nodes (:data:`TRACED_TYPES`) as value_info,
    fix the sizes that cannot change (:func:`_fix_static_sizes`), and remove that attribute
    (the engine knows no such attribute)."""
    declared = {
        vi.name for vi in (*graph.value_info, *graph.output) if vi.type.tensor_type.elem_type
    }
    traced: dict[str, tuple[onnx.NodeProto, list[int]]] = {}
    for node in graph.node:
        if node.domain != ATEN_DOMAIN:
            continue
        found = [a for a in node.attribute if a.name == TRACED_TYPES]
        if not found:
            continue
        node.attribute.remove(found[0])
        for name, spec in zip(node.output, found[0].s.decode().split(","), strict=False):
            if not name or not spec:
                continue
            elem, rank, *sizes = spec.split(":")
            if sizes and sizes[0] != "?":
                traced[name] = (node, [int(n) for n in sizes[0].split("x")] if sizes[0] else [])
            if name in declared:
                continue
            graph.value_info.append(
                onnx.helper.make_tensor_value_info(name, int(elem), [None] * int(rank))
            )
            declared.add(name)
    _fix_static_sizes(graph, traced)


def _fix_static_sizes(
    graph: onnx.GraphProto, traced: Mapping[str, tuple[onnx.NodeProto, list[int]]]
) -> None:
    """Declare an ATen output's traced sizes as fixed where they cannot change: every input of
    its node has fixed dims (or is a constant) and the output has their broadcast shape
    (``softplus`` of a parameter of shape ``(1,)``, or of an input's fixed dim of size 1).

    Engine workaround: the exporter names an ATen output's dims it cannot infer
    (``ATen/<output>_dim_0``) or leaves them unknown. The engine's gradient builder takes two
    differently named dims for equal (``ComputeBroadcastBackwardAxes``, onnxruntime 1.19), so
    ``softplus(x1) * x0`` with ``x1`` of shape ``(1,)`` and ``x0`` of ``(4, 1, 2)`` did not reduce
    ``x1``'s gradient over the last axis (a Reshape error in the backward), and an unknown dim
    failed the build (``GetShape(input_grad)`` in ``HandleBroadcasting``) for
    ``softplus(p) * x`` with a parameter ``p``. Operators whose sizes depend on values
    (:func:`data_dependent_sizes`) are left as they are."""
    if not traced:
        return
    shapes = value_shapes(graph)  # initializers included, with their dims
    # a Constant node's output has no declared shape; as a scalar argument it broadcasts away
    constants = {
        o
        for n in graph.node
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
        for o in n.output
    }
    entries: dict[str, list[onnx.ValueInfoProto]] = {}
    for vi in (*graph.value_info, *graph.output):
        entries.setdefault(vi.name, []).append(vi)
    for name, (node, sizes) in traced.items():
        operator = node.op_type if node.op_type != "ATen" else str(attribute(node, "operator", ""))
        if data_dependent_sizes(operator.split(".")[0]) or name not in entries:
            continue
        if _broadcast_of_fixed_inputs(node, shapes, constants) != sizes:
            continue
        for entry in entries[name]:
            tensor = entry.type.tensor_type
            if tensor.HasField("shape") and len(tensor.shape.dim) != len(sizes):
                continue
            tensor.shape.Clear()
            for n in sizes:
                tensor.shape.dim.add().dim_value = n


def _broadcast_of_fixed_inputs(
    node: onnx.NodeProto,
    shapes: Mapping[str, tuple[int, list[int | None] | None]],
    constants: set[str],
) -> list[int] | None:
    """The broadcast shape of ``node``'s inputs when every one has fixed dims (a constant of no
    declared shape is passed over), else None."""
    fixed: list[tuple[int, ...]] = []
    for i in node.input:
        if not i:
            continue
        known = shapes.get(i)
        dims = known[1] if known is not None else None
        if dims is None or any(d is None for d in dims):
            if i in constants:
                continue
            return None
        fixed.append(tuple(int(d) for d in dims if d is not None))
    if not fixed:
        return None
    try:
        return list(np.broadcast_shapes(*fixed))
    except ValueError:
        return None


def _type_aten_outputs(model: onnx.ModelProto) -> None:
    """Declare the element type (and rank) of ATen outputs the exporter left untyped: the
    engine cannot infer them, an ATen node's outputs may be of any type."""
    graph = model.graph
    # The engine turns graph outputs into inputs of its Yield node and keeps only value_info
    # types there, so an ATen node's graph output needs a value_info entry too.
    in_value_info = {vi.name for vi in graph.value_info}
    for vi in graph.output:
        producer = next((n for n in graph.node if vi.name in n.output), None)
        if (
            producer is not None
            and producer.domain == ATEN_DOMAIN
            and vi.type.tensor_type.elem_type
        ):
            if vi.name not in in_value_info:
                graph.value_info.append(vi)
    declared = {
        vi.name for vi in (*graph.value_info, *graph.output) if vi.type.tensor_type.elem_type
    }
    todo = [
        n
        for n in graph.node
        if n.domain == ATEN_DOMAIN and any(o and o not in declared for o in n.output)
    ]
    if not todo:
        return
    constants = constant_values(graph)
    strings, sequences = _string_constants(graph), _sequence_inputs(graph)
    known = inferred_value_shapes(model)
    for node in todo:
        if any(name and name not in known and name not in constants for name in node.input):
            known = inferred_value_shapes(model)
        types = _output_types(node, known, constants, strings, sequences)
        if types is None:
            logger.warning(
                "could not type the outputs of ATen node %s; the engine may refuse it", node.name
            )
            continue
        for name, (elem_type, rank) in zip(node.output, types, strict=False):
            if not name or name in declared:
                continue
            shape = [None] * rank if rank is not None else None
            graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, shape))
            declared.add(name)
            known[name] = (elem_type, [None] * rank if rank is not None else None)
        for vi in graph.output:  # a graph output produced by the node: fill its type in place
            if vi.name in node.output and not vi.type.tensor_type.elem_type:
                vi.type.tensor_type.elem_type = types[list(node.output).index(vi.name)][0]


def _as_python_op(
    node: onnx.NodeProto,
    types: Mapping[str, int],
    ranks: Mapping[str, int | None],
    training: bool,
    strings: Mapping[str, str] | None = None,
    sequences: Mapping[str, list[str]] | None = None,
) -> list[onnx.NodeProto]:
    """``node`` (an ATen node) as a PythonOp running :class:`AtenOp`, plus casts of bool outputs.

    ``strings``: inputs that are string constants (passed as Python strings); ``sequences``:
    inputs that are ``SequenceConstruct`` outputs (passed as their tensors, packed back into a
    list by :class:`AtenOp`)."""
    strings = strings or {}
    sequences = sequences or {}

    python_op_runner.install()  # the node needs the PythonOp runners
    entry = REGISTRY.register(AtenOp)
    operator = attribute(node, "operator", "")
    overload = attribute(node, "overload_name", "") or ""
    pointers: list[int] = []
    positions = [0]
    convention = "c"
    tensors, input_types, input_ranks = [], [], []
    groups: list[str] = []
    position = 1
    for name in node.input:
        if not name or name in strings:
            # a missing optional argument, or a string (the engine has no string tensors)
            convention += "c"
            pointers.append(REGISTRY.keep(strings.get(name)))
            positions.append(position)
            position += 1
            continue
        members = sequences.get(name, [name])
        if name in sequences:
            groups.append(f"{position - 1}:{len(members)}")
        for member in members:
            if not member:
                # a None in an optional-tensor list (``x[..., idx]``: index's Tensor?[])
                convention += "c"
                pointers.append(REGISTRY.keep(None))
                positions.append(position)
                position += 1
                continue
            convention += "d"
            elem = types.get(member, onnx.TensorProto.FLOAT)
            if elem == onnx.TensorProto.BOOL:
                entry.bool_inputs.add(position)
            tensors.append(member)
            input_types.append(elem)
            input_ranks.append(ranks.get(member) or 0)
            position += 1
    spec = f"{operator}|{overload}"
    if aten_executor.returns_list(operator, overload, len(node.input)):
        # one output per list element the graph reads (_unpack_list_outputs)
        spec += f"|{','.join(groups)}|{len(node.output)}"
    elif groups:
        spec += f"|{','.join(groups)}"
    pointers.insert(0, REGISTRY.keep(spec))
    tag = node.name or f"aten_{operator}_{id(node)}"
    outputs: list[str] = [f"{tag}_ctx"]
    output_types: list[int] = []
    output_ranks: list[int] = []
    casts: list[onnx.NodeProto] = []
    for name in node.output:
        elem = types.get(name, onnx.TensorProto.FLOAT)
        output_ranks.append(ranks.get(name) or 0)
        if elem == onnx.TensorProto.BOOL:
            raw = f"{name}__uint8"
            casts.append(onnx.helper.make_node("Cast", [raw], [name], to=onnx.TensorProto.BOOL))
            outputs.append(raw)
            output_types.append(onnx.TensorProto.UINT8)
        else:
            outputs.append(name)
            output_types.append(elem)
    op = python_op_node(
        entry,
        tensors,
        outputs,
        name=tag,
        convention=convention,
        types=(input_types, output_types),
        ranks=(input_ranks, output_ranks),
        training=training,
        scalars={"pointer": (pointers, positions)},
        comment=f"aten::{operator}.{overload or 'default'}",
    )
    return [op, *casts]


def _string_constants(graph: onnx.GraphProto) -> dict[str, str]:
    """Constant values that are one string (an ATen node's ``reduce="amax"`` and the like)."""
    found = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.type == onnx.AttributeProto.STRING:  # torch writes value= as a string
                    found[node.output[0]] = a.s.decode()
                elif a.name == "value" and a.t.data_type == onnx.TensorProto.STRING:
                    values = list(a.t.string_data)
                    if len(values) == 1:
                        found[node.output[0]] = values[0].decode()
    return found


def _sequence_inputs(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """``SequenceConstruct`` outputs read by ATen nodes -> the tensors they hold."""
    read = {name for n in graph.node if n.domain == ATEN_DOMAIN for name in n.input}
    return {
        n.output[0]: list(n.input)
        for n in graph.node
        if n.op_type == "SequenceConstruct" and n.output[0] in read
    }


def _unpack_list_outputs(graph: onnx.GraphProto) -> int:
    """Give an ATen node that returns a list (``dsplit``, ``unbind_copy``, ``gradient``, ...)
    one output per element up to the last one read, where the graph reads that list only
    through ``SequenceAt`` at constant indices (the exporter's unpacking of the traced list, or
    ``torch.dsplit(x, 2)[0]``). The engine has no sequence-typed ATen output; the executor hands
    the list back as its first elements (``aten.executor.first_elements``).
    Returns how many nodes changed."""
    constants = constant_values(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    graph_outputs = {vi.name for vi in graph.output}
    dropped: set[int] = set()
    #: id of an unpacked node -> Identity nodes for elements read more than once
    copies: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.domain != ATEN_DOMAIN or len(node.output) != 1:
            continue
        sequence = node.output[0]
        uses = readers.get(sequence, [])
        if not uses or sequence in graph_outputs:
            continue
        if any(u.op_type != "SequenceAt" or list(u.input)[:1] != [sequence] for u in uses):
            continue
        positions = [constants.get(u.input[1]) if len(u.input) > 1 else None for u in uses]
        if any(p is None or np.ndim(p) != 0 for p in positions):
            continue
        indices = [int(p) for p in positions]  # type: ignore[arg-type]
        if min(indices) < 0:
            continue  # counted from the end: the list's length is not known here
        names: dict[int, str] = {}
        copies[id(node)] = []
        for use, index in zip(uses, indices, strict=True):
            if index in names:  # the same element read twice
                copies[id(node)].append(
                    onnx.helper.make_node("Identity", [names[index]], list(use.output))
                )
            else:
                names[index] = use.output[0]
            dropped.add(id(use))
        del node.output[:]
        # the executor hands back the list's first max(index) + 1 elements
        node.output.extend(names.get(i, f"{sequence}__unread{i}") for i in range(max(indices) + 1))
    if not copies:
        return 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        nodes.append(node)
        nodes.extend(copies.get(id(node), ()))
    del graph.node[:]
    graph.node.extend(nodes)
    return len(copies)


def prepare_aten_nodes(model: onnx.ModelProto, training: bool = True) -> int:
    """Make every ATen node of ``model`` runnable and trainable; returns how many there are.

    * ``org.pytorch.aten::<op>`` nodes (what the exporter writes when a symbolic gives up under
      ``ONNX_ATEN_FALLBACK``) become ``ATen(operator=<op>)``, and their outputs get types;
    * in a training graph, a differentiable node whose operator has no gradient definition
      (:mod:`ortmodule_exporter.aten.gradients`) becomes a PythonOp running :class:`AtenOp`;
    * bool inputs are recorded for the executor (the engine hands bool tensors over as uint8)
      and bool outputs are cast back from the uint8 the executor returns.
    """
    graph = model.graph
    _declare_traced_types(graph)
    for node in graph.node:
        if node.domain == ATEN_DOMAIN and node.op_type != "ATen":
            operator = node.op_type
            node.op_type = "ATen"
            del node.attribute[:]
            node.attribute.extend(
                [
                    onnx.helper.make_attribute("operator", operator),
                    onnx.helper.make_attribute("overload_name", ""),
                ]
            )
    if not any(n.domain == ATEN_DOMAIN for n in graph.node):
        return 0
    _unpack_list_outputs(graph)
    _type_aten_outputs(model)
    known = inferred_value_shapes(model)
    types = {**{name: elem for name, (elem, _dims) in known.items()}, **_value_types(model)}
    ranks = {name: (len(dims) if dims is not None else None) for name, (_t, dims) in known.items()}
    count = 0
    nodes: list[onnx.NodeProto] = []
    strings, sequences = _string_constants(graph), _sequence_inputs(graph)
    for node in graph.node:
        if node.domain != ATEN_DOMAIN:
            nodes.append(node)
            continue
        count += 1
        operator = attribute(node, "operator", "")
        overload = attribute(node, "overload_name", "") or ""
        internal = operator.startswith("_ortmodule_") and operator != EINSUM
        float_out = any(name and types.get(name) in FLOAT_TYPES for name in node.output)
        elements = [m for name in node.input for m in sequences.get(name, [name])]
        float_in = any(name and types.get(name) in FLOAT_TYPES for name in elements)
        # the engine's ATen kernel passes tensors only: strings and lists go through a PythonOp
        untensored = any(name in strings or name in sequences for name in node.input)
        if not internal and (
            untensored
            or (training and float_out and float_in and not has_gradient(operator, overload))
        ):
            nodes.extend(_as_python_op(node, types, ranks, training, strings, sequences))
            continue
        bools = {
            i
            for i, name in enumerate(node.input)
            if name and types.get(name) == onnx.TensorProto.BOOL
        }
        if bools:
            aten_executor.BOOL_INPUTS.setdefault((operator, overload), set()).update(bools)
        nodes.append(node)
        for slot, name in enumerate(node.output):
            if name and types.get(name) == onnx.TensorProto.BOOL:
                raw = f"{name}__uint8"
                node.output[slot] = raw
                nodes.append(onnx.helper.make_node("Cast", [raw], [name], to=onnx.TensorProto.BOOL))
                # the engine cannot infer an ATen output's type: declare the raw one
                rank = ranks.get(name)
                graph.value_info.append(
                    onnx.helper.make_tensor_value_info(
                        raw, onnx.TensorProto.UINT8, [None] * rank if rank is not None else None
                    )
                )
    used = {name for n in nodes for name in n.input} | {o.name for o in graph.output}
    # lists and strings now reach the PythonOps directly; the engine has no use for them
    nodes = [
        n
        for n in nodes
        if not (n.op_type == "SequenceConstruct" or n.output[0] in strings)
        or any(o in used for o in n.output)
    ]
    del graph.node[:]
    graph.node.extend(nodes)
    if any(n.domain == PYTHON_OP_DOMAIN for n in nodes):
        import_domain(model, PYTHON_OP_DOMAIN)
    return count


def _aten_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    prepare_aten_nodes(exported.model, exported.training)


register_post_export_pass("aten_nodes", _aten_pass, order=40)
