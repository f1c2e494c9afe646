"""Zero-element tensors in the ``torch_export`` frontend's ONNX graph, for the engine (1.19.2).

The engine's kernels and gradient builders mishandle empty tensors (``aten/empty_tensors.py``
lists what the TorchScript frontend found: the broadcasting gradient of every binary op
reshapes a ``ReduceSum`` that reduced all of an empty gradient, ``{1,1,1}``, into the empty
shape; SliceGrad and LayerNormalizationGrad fail; Gemm asserts ``K > 0``; MatMul over an empty
inner dimension returns uninitialised memory). The TorchScript frontend runs such operators in
PyTorch; here the graph is rewritten so that the engine never computes on an empty tensor:

* a node writing an empty (float) tensor writes ``Expand(link, shape)`` instead, ``link`` being
  a scalar that sums every float input of the node (``ReduceSum``, over all its elements). The
  value is the same (no element), so is the gradient: the sum of an empty output gradient is
  0, and that 0 is what each input gets, zeros of its shape (eager's gradient of an operator
  whose output has no element). The output stays differentiable and its inputs reachable, so
  ``requires_grad`` and the inputs' gradients (zeros, or empty) are eager's;
* a node whose float inputs are all empty and whose output is not (``MatMul`` over an empty
  inner dimension, a reduction of an empty tensor) writes the operator's value on no element
  (0, 1, NaN, -inf: :data:`EMPTY_REDUCTION_VALUES`) plus ``Expand(link, shape)`` (``link`` sums
  empty tensors: exactly 0, and carries the inputs' empty gradients back);
* ``Gemm`` over an empty inner dimension is ``beta * C`` (plus the link), ``Concat`` drops
  its empty inputs (the engine's ``SplitTraining`` gradient loses their lengths).

Nodes the engine handles on empty tensors (unary elementwise ones, ``SAFE_ON_EMPTY``, the
TorchScript frontend's list) and nodes without float outputs (``Shape``, comparisons) are kept.
An empty value is one whose static shape (the export's or ONNX shape inference's) has a 0 dim:
torch.export fixes the dims of an empty input (``torch_export._dynamic_shapes``), so another
empty shape is another graph. A node on an empty tensor that none of these rules covers is an
:class:`ExportError` naming it, never a silent wrong result.

>>> from ortmodule_exporter.export.torch_export_empty import stub_zero_element_nodes
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx
import onnx.shape_inference

from ..aten.empty_tensors import SAFE_ON_EMPTY
from ..aten.executor import ATEN_DOMAIN
from ..errors import ExportError
from ..onnx_graph import FLOAT_TYPES, value_shapes

__all__ = ["EMPTY_REDUCTION_VALUES", "stub_zero_element_nodes"]

#: op -> its value on no element, for the ops that reduce over an empty dimension to a
#: non-empty output (ONNX's definitions, which are PyTorch's where PyTorch defines them)
EMPTY_REDUCTION_VALUES: dict[str, float] = {
    "MatMul": 0.0,
    "Einsum": 0.0,
    "ReduceSum": 0.0,
    "ReduceSumSquare": 0.0,
    "ReduceL1": 0.0,
    "ReduceL2": 0.0,
    "ReduceMean": math.nan,
    "ReduceProd": 1.0,
    "ReduceLogSum": -math.inf,
    "ReduceLogSumExp": -math.inf,
}

_Shapes = dict[str, tuple[int, list[int | None] | None]]


def _known(model: onnx.ModelProto) -> _Shapes:
    """Every value's element type and static dims: declared, else inferred from a copy of the
    graph whose small integer computations (sizes, pads, targets of Reshape, as torch_lib
    computes them from ``Shape``) are folded into constants, so that shape inference sees
    them."""
    known = value_shapes(model.graph)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    for _ in range(2):
        try:
            inferred = value_shapes(onnx.shape_inference.infer_shapes(folded).graph)
        except Exception:  # noqa: BLE001 - inference is best effort, declared shapes still hold
            break
        for name, (elem, dims) in inferred.items():
            before = known.get(name, (0, None))[1]
            if dims is not None and (before is None or (None in before and None not in dims)):
                known[name] = (elem, dims)
        if not _fold_integers(folded, known):
            break
    return known


#: integer results folded for shape inference up to this many elements
_FOLD_LIMIT = 1024


def _fold_integers(model: onnx.ModelProto, known: _Shapes) -> bool:
    """Replace, in ``model``, each node computing small integer tensors from constants (and
    ``Shape`` of a value of static shape) by ``Constant`` nodes; whether any was."""
    import numpy as np  # noqa: PLC0415
    from onnx.reference import ReferenceEvaluator  # noqa: PLC0415

    h = onnx.helper
    values: dict[str, np.ndarray] = {}
    integer = (onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL)
    changed = False
    new_nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        default = node.domain in ("", "ai.onnx")
        got: list[np.ndarray] | None = None
        if default and node.op_type == "Constant":
            attr = node.attribute[0]
            try:
                got = [
                    onnx.numpy_helper.to_array(attr.t)
                    if attr.name == "value"
                    else np.array(h.get_attribute_value(attr))
                ]
            except Exception:  # noqa: BLE001 - sparse or string constants are not folded
                got = None
            if got is not None:
                values[node.output[0]] = got[0]
            new_nodes.append(node)
            continue
        dims = known.get(node.input[0], (0, None))[1] if node.input else None
        if default and node.op_type == "Shape" and dims is not None and None not in dims:
            start = next((a.i for a in node.attribute if a.name == "start"), 0)
            end = next((a.i for a in node.attribute if a.name == "end"), len(dims))
            got = [np.array(dims[start:end], dtype=np.int64)]
        elif (
            default
            and node.input
            and all(i in values for i in node.input if i)
            and all(known.get(o, (0, None))[0] in integer for o in node.output if o)
            and not any(a.HasField("g") or len(a.graphs) for a in node.attribute)
        ):
            try:
                feeds = {i: values[i] for i in node.input if i}
                got = [np.asarray(v) for v in ReferenceEvaluator(node).run(None, feeds)]
            except Exception:  # noqa: BLE001 - what cannot be folded keeps its node
                got = None
        if got is None or any(np.asarray(v).size > _FOLD_LIMIT for v in got):
            new_nodes.append(node)
            continue
        for out, value in zip(node.output, got, strict=False):
            if out:
                values[out] = np.asarray(value)
                tensor = onnx.numpy_helper.from_array(np.asarray(value), out)
                new_nodes.append(h.make_node("Constant", [], [out], value=tensor))
        changed = True
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return changed


def _is_empty(known: _Shapes, name: str) -> bool:
    dims = known.get(name, (0, None))[1] if name else None
    return dims is not None and 0 in dims


def stub_zero_element_nodes(model: onnx.ModelProto) -> None:
    """Every rewrite of the module docstring, in place."""
    graph = model.graph
    declared = value_shapes(graph)
    # the export declares the shape of every value torch.export traced (an empty one has a
    # fixed 0 dim): without one, inference and folding are not worth their time
    if not any(_is_empty(declared, name) for name in declared):
        return
    known = _known(model)
    before = set(known)
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        new_nodes += _rewrite(node, index, known)
    del graph.node[:]
    graph.node.extend(new_nodes)
    _declare_kept_outputs(graph, {n: known[n] for n in known if n not in before})


def _declare_kept_outputs(graph: onnx.GraphProto, kept: _Shapes) -> None:
    """Declare the type of each renamed output of a node kept for its shapes (:func:`_replaced`):
    the engine cannot infer the output types of an ``ATen`` node (or other custom operator)
    and refuses the graph ("output arg ... type inference failed") without a declaration; the
    node's original outputs were declared by the export."""
    h = onnx.helper
    for name, (elem, dims) in kept.items():
        if not elem:
            continue
        shape = None if dims is None else [d if d is not None else f"{name}_dim{k}"
                                           for k, d in enumerate(dims)]  # fmt: skip
        graph.value_info.append(h.make_tensor_value_info(name, elem, shape))


def _rewrite(node: onnx.NodeProto, index: int, known: _Shapes) -> list[onnx.NodeProto]:
    default = node.domain in ("", "ai.onnx")
    values = [n for n in (*node.input, *node.output) if n]
    if not any(_is_empty(known, n) for n in values):
        return [node]
    if default and node.op_type in SAFE_ON_EMPTY:
        return [node]

    def elem(name: str) -> int:
        return known.get(name, (0, None))[0]

    outputs = [o for o in node.output if o]
    if not any(elem(o) in FLOAT_TYPES for o in outputs) and all(elem(o) for o in outputs):
        return [node]  # Shape, Size, comparisons, indices: no gradient goes through them
    if node.domain == ATEN_DOMAIN and _empty_values_without_gradient(values, known, elem):
        # PyTorch runs an ATen node, forward and backward, and handles empty tensors; its
        # empty values here are integer ones, which carry no gradient into the engine: an
        # int[] argument given as [] (avg_pool2d's stride), the uint8 reserve that
        # _batch_norm_with_update writes on CPU beside its non-empty outputs
        return [node]
    where = f"{node.op_type} node {node.name or index} of the torch_export graph"
    if _has_subgraphs(node):
        raise ExportError(
            f"the {where} (with subgraphs) reads or writes a zero-element tensor, which the "
            "engine cannot differentiate; use ORTMODULE_EXPORTER=torchscript"
        )
    float_inputs = [i for i in node.input if i and elem(i) in FLOAT_TYPES]
    empty_inputs = [i for i in float_inputs if _is_empty(known, i)]
    tag = f"{node.name or node.op_type}_{index}_empty"
    if all(_is_empty(known, o) for o in outputs):
        # no element out: its value is none, its inputs' gradients zeros
        link, built = _link(float_inputs, elem, tag)
        return _replaced(node, outputs, known, link, 0.0, tag, where, built)
    if not empty_inputs:
        # only an output is empty (Split, TopK with k = 0): not seen yet
        raise ExportError(
            f"the {where} writes a zero-element tensor beside a non-empty one, which the engine "
            "mishandles; use ORTMODULE_EXPORTER=torchscript"
        )
    # link sums empty tensors only: exactly 0, and their (empty) gradients go back through it
    link, built = _link(empty_inputs, elem, tag)
    if len(empty_inputs) == len(float_inputs) and default:
        value = EMPTY_REDUCTION_VALUES.get(node.op_type)
        if value is not None:
            return _replaced(node, outputs, known, link, value, tag, where, built)
    if default and node.op_type == "Concat" and len(outputs) == 1:
        # the engine's gradient of Concat (SplitTraining) loses an empty part's length
        kept = [i for i in node.input if i and not _is_empty(known, i)]
        concat = f"{tag}_concat"
        del node.input[:]
        node.input.extend(kept)
        out, node.output[0] = node.output[0], concat
        return [*built, node, *_plus_link(concat, out, link, elem(out), tag)]
    if default and node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        # an empty inner dimension (A or B empty, the output not): alpha * A @ B is 0, the
        # engine's Gemm asserts K > 0 instead
        c, out = node.input[2], node.output[0]
        beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0)
        dims = known.get(out, (0, None))[1]
        if dims is None or None in dims or not elem(out):
            raise ExportError(f"the {where} has an output of unknown shape or type")
        h = onnx.helper
        scaled = f"{tag}_scaled_c"
        beta_name = f"{tag}_beta"
        return [
            *built,
            h.make_node(
                "Constant", [], [beta_name], value=h.make_tensor(beta_name, elem(out), [], [beta])
            ),
            h.make_node("Mul", [c, beta_name], [scaled]),
            *_outputs(
                [f"{tag}_product"], {f"{tag}_product": (elem(out), dims)}, link, 0.0, tag, where
            ),
            h.make_node("Add", [f"{tag}_product", scaled], [out]),
        ]
    raise ExportError(
        f"the {where} computes a non-empty output from a zero-element tensor, which the engine "
        "mishandles, and ORTModule knows no rewrite for it: use ORTMODULE_EXPORTER=torchscript"
    )


def _empty_values_without_gradient(
    values: list[str], known: _Shapes, elem: Callable[[str], int]
) -> bool:
    """Whether every empty one of ``values`` is of a known type that is not float."""
    empty = [v for v in values if _is_empty(known, v)]
    return all(elem(v) and elem(v) not in FLOAT_TYPES for v in empty)


def _replaced(
    node: onnx.NodeProto,
    outputs: list[str],
    known: _Shapes,
    link: str,
    value: float,
    tag: str,
    where: str,
    built: list[onnx.NodeProto],
) -> list[onnx.NodeProto]:
    """``built`` then nodes writing ``outputs`` as :func:`_outputs` does, ``node`` kept to
    give them their shapes when some dim is symbolic."""
    symbolic = [o for o in outputs if None in (known.get(o, (0, None))[1] or [None])]
    if not symbolic:
        return built + _outputs(outputs, known, link, value, tag, where)
    # the node still runs forward for its outputs' shapes (the engine's forward kernels size
    # empty tensors right); only Shape reads it, so no gradient goes through it
    renamed = {o: f"{tag}_shape_of{k}" for k, o in enumerate(outputs)}
    known.update({renamed[o]: known[o] for o in outputs if o in known})
    for slot, o in enumerate(node.output):
        if o:
            node.output[slot] = renamed[o]
    return [node, *built, *_outputs(outputs, known, link, value, tag, where, renamed)]


def _has_subgraphs(node: onnx.NodeProto) -> bool:
    return any(a.HasField("g") or len(a.graphs) for a in node.attribute)


def _link(
    inputs: list[str], elem: Callable[[str], int], tag: str
) -> tuple[str, list[onnx.NodeProto]]:
    """A float scalar summing every element of ``inputs`` (in the first one's type), and the
    nodes computing it; ``""`` and none without inputs."""
    if not inputs:
        return "", []
    h = onnx.helper
    built: list[onnx.NodeProto] = []
    parts = []
    for k, name in enumerate(inputs):
        part = f"{tag}_sum{k}"
        built.append(h.make_node("ReduceSum", [name], [part], keepdims=0))
        if elem(name) != elem(inputs[0]):
            built.append(h.make_node("Cast", [part], [f"{part}_cast"], to=elem(inputs[0])))
            part = f"{part}_cast"
        parts.append(part)
    link = parts[0]
    for k, part in enumerate(parts[1:]):
        # Add of scalars: the engine has no gradient for Sum
        built.append(h.make_node("Add", [link, part], [f"{tag}_linksum{k}"]))
        link = f"{tag}_linksum{k}"
    return link, built


def _outputs(
    outputs: list[str],
    known: _Shapes,
    link: str,
    value: float,
    tag: str,
    where: str,
    shaped_like: dict[str, str] | None = None,
) -> list[onnx.NodeProto]:
    """Nodes writing each of ``outputs`` (of known type, and static shape unless
    ``shaped_like`` names a value of its shape): ``value`` everywhere plus ``link`` broadcast
    (float outputs, when there is a link)."""
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    for k, out in enumerate(outputs):
        dtype, maybe = known.get(out, (0, None))
        dims = [d for d in maybe or () if d is not None]
        shape = f"{tag}_shape{k}"
        if shaped_like and out in shaped_like and maybe is not None and dtype:
            # a symbolic dim beside the 0: the shape the node computes, at run time
            nodes.append(h.make_node("Shape", [shaped_like[out]], [shape]))
        elif maybe is None or len(dims) != len(maybe) or not dtype:
            raise ExportError(
                f"the {where} writes {out} of unknown shape or type from a zero-element tensor, "
                "which the engine mishandles; use ORTMODULE_EXPORTER=torchscript"
            )
        else:
            nodes.append(
                h.make_node(
                    "Constant",
                    [],
                    [shape],
                    value=h.make_tensor(shape, onnx.TensorProto.INT64, [len(dims)], dims),
                )
            )
        if not link or dtype not in FLOAT_TYPES:
            fill = h.make_tensor(
                f"{tag}_fill{k}", dtype, [1], [value if dtype in FLOAT_TYPES else 0]
            )
            nodes.append(h.make_node("ConstantOfShape", [shape], [out], value=fill))
            continue
        linked = f"{tag}_link{k}"
        nodes.append(h.make_node("Cast", [link], [linked], to=dtype))
        if value != 0.0 and 0 not in dims:
            constant = f"{tag}_value{k}"
            nodes += [
                h.make_node(
                    "Constant", [], [constant], value=h.make_tensor(constant, dtype, [], [value])
                ),
                h.make_node("Add", [linked, constant], [f"{linked}_valued"]),
            ]
            linked = f"{linked}_valued"
        nodes.append(h.make_node("Expand", [linked, shape], [out]))
    return nodes


def _plus_link(value: str, out: str, link: str, dtype: int, tag: str) -> list[onnx.NodeProto]:
    """``out = value + link`` (link: an exact 0 carrying empty inputs' gradients)."""
    h = onnx.helper
    return [
        h.make_node("Cast", [link], [f"{tag}_link_cast"], to=dtype),
        h.make_node("Add", [value, f"{tag}_link_cast"], [out]),
    ]
