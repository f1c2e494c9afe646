"""Rewrites of the ``torch_export`` frontend's ONNX graph for the engine's gradient builder
(1.19.2), which torch_lib's translations do not anticipate; :func:`fix_for_engine` applies them
in order. Each says which engine behaviour it works around; the TorchScript frontend's
symbolics do the same at export (``symbolics/``).

>>> from ortmodule_exporter.export.torch_export_fixes import fix_for_engine
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import onnx
import onnx.shape_inference

from .. import onnx_graph
from ..aten.executor import ATEN_DOMAIN
from ..aten.stop_gradient import STOP_GRADIENT as ATEN_STOP_GRADIENT
from ..errors import ExportError
from .gradient_cuts import STOP_GRADIENT
from .torch_export_empty import stub_zero_element_nodes
from .torch_export_kernels import widen_narrow_integer_operands

__all__ = ["cut_gradients_of_outputs", "fix_for_engine"]


def fix_for_engine(model: onnx.ModelProto) -> None:
    """Every rewrite below, in place, in the order they depend on each other."""
    _cast_like_as_cast(model)
    stub_zero_element_nodes(model)
    _pow_exponent_as_base_type(model)
    _integer_operands_as_float(model)
    _scalar_operands_as_vectors(model)
    _transposes_with_perm(model)
    _whole_slices_as_identity(model)
    _l2_norms_by_sums(model)
    _reductions_of_scalars(model)
    _reversed_slices_as_gathers(model)
    _matmul_vectors_as_matrices(model)
    _scatter_add_onto_zeros(model)
    _outputs_for_gradients(model)
    _layer_norm_bias(model)
    _layer_norm_centered(model)
    _max_pool_values_gathered(model)
    _where_branches_expanded(model)
    _stop_gradients_as_engine_cuts(model)

    widen_narrow_integer_operands(model)


#: ops that keep their first input's elements (their order aside)
_VALUE_KEEPING = frozenset({"Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})

#: a Slice end at or past this takes the rest of the axis (torch_lib writes ``sys.maxsize`` for
#: ``x[:, ...]``'s open end)
_OPEN_END = 1 << 62


def _whole_slices_as_identity(model: onnx.ModelProto) -> None:
    """A ``Slice`` that keeps every element (starts 0, open ends, steps 1: torch_lib's
    ``x[:, 0]`` slices the batch axis whole before it picks position 0) -> Identity.

    Padding elimination reads ``hidden[:, 0]`` (a classifier's first token) as a ``Gather``
    of the rows; a whole Slice before it read as a token-wise node it cannot follow, and the
    pass stayed off for HF sequence classifiers on this frontend."""
    values = onnx_graph.constant_values(model.graph)
    producer = {o: n for n in model.graph.node for o in n.output if o}

    def ints(name: str) -> list[int] | None:
        """The constant's elements, read through the value-keeping ops torch_lib puts
        between a constant and the Slice (``Reshape(Cast(Constant), [-1])``)."""
        seen = 0
        while name not in values and name in producer and seen < 8:
            node = producer[name]
            if node.op_type not in _VALUE_KEEPING or not node.input:
                return None
            name, seen = node.input[0], seen + 1
        found = values.get(name)
        return None if found is None else [int(v) for v in found.reshape(-1)]

    for node in model.graph.node:
        if not _is_default(node, "Slice") or len(node.input) < 3:
            continue
        starts, ends = ints(node.input[1]), ints(node.input[2])
        steps = ints(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
        if (
            starts is not None
            and ends is not None
            and steps is not None
            and all(v == 0 for v in starts)
            and all(v >= _OPEN_END for v in ends)
            and all(v == 1 for v in steps)
        ):
            node.op_type = "Identity"
            del node.input[1:]


def _transposes_with_perm(model: onnx.ModelProto) -> None:
    """A ``Transpose`` without ``perm`` (torch_lib's ``permute(())`` of a 0-d tensor: an empty
    ``perm`` is not written) gets its default, the reversed axes; of a 0-d input it is an
    Identity.

    The engine's Transpose gradient (1.19.2) reads the ``perm`` attribute and fails the build
    with ``unordered_map::at`` when there is none."""
    found = [
        n
        for n in model.graph.node
        if _is_default(n, "Transpose") and not any(a.name == "perm" for a in n.attribute)
    ]
    if not found:
        return
    ranks = _ranks_of(model, [n.input[0] for n in found])
    for node in found:
        rank = ranks.get(node.input[0])
        if rank == 0:
            node.op_type = "Identity"
        elif rank is not None:
            node.attribute.append(onnx.helper.make_attribute("perm", list(range(rank))[::-1]))


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    return onnx_graph.declared_types(model)


#: op -> how many outputs the engine's gradient builder reads (1.19.2): torch_lib writes only
#: the first, the builder reads the saved statistics, the log-probabilities or the argmax
#: indices, and crashes (an index check, or a segmentation fault for MaxPool) without them
_GRADIENT_OUTPUTS = {
    "LayerNormalization": 3,
    "SimplifiedLayerNormalization": 2,
    "SoftmaxCrossEntropyLoss": 2,
    "MaxPool": 2,
    "Dropout": 2,
}


def _outputs_for_gradients(model: onnx.ModelProto) -> None:
    for index, node in enumerate(model.graph.node):
        wanted = _GRADIENT_OUTPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if wanted is None:
            continue
        while len(node.output) < wanted:
            node.output.append("")
        for slot in range(1, wanted):
            if not node.output[slot]:
                node.output[slot] = f"{node.name or node.op_type}_{index}_out{slot}"


def _layer_norm_bias(model: onnx.ModelProto) -> None:
    """A LayerNormalization without bias (``nn.LayerNorm(bias=False)``) gets a zero one: the
    engine's gradient builder (1.19.2) reads the bias input unconditionally."""
    graph = model.graph
    norms = [
        n
        for n in graph.node
        if n.op_type == "LayerNormalization" and (len(n.input) < 3 or not n.input[2])
    ]
    if not norms:
        return
    types = _elem_types(model)
    if any(n.input[1] not in types for n in norms):
        types.update(_elem_types(onnx.shape_inference.infer_shapes(model)))
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if node in norms:
            scale = node.input[1]
            dtype = types.get(scale, 0)
            if not dtype:
                raise ExportError(
                    f"the torch_export graph's LayerNormalization {node.name} has no bias and a "
                    "scale of unknown type; the engine cannot differentiate it"
                )
            tag = f"{node.name or 'LayerNormalization'}_{index}"
            new_nodes += _zeros_like(scale, f"{tag}_zero_bias", dtype)
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = f"{tag}_zero_bias"
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


def _layer_norm_centered(model: onnx.ModelProto) -> None:
    """A float32 LayerNormalization normalises its input minus the input's mean.

    The engine's CPU LayerNormalization (1.19.2) computes the variance as ``E[x^2] - E[x]^2``
    in float32: when the mean is large against the spread, the difference cancels (rows
    ``[10, 10.003]`` came out 0.474 for eager's 0.429; the fuzzer's seed 33, off by 3e-3).
    Centred first, ``E[x]`` is about 0 and the variance as exact as eager's; the output and
    the gradient are the same functions (a layer norm does not see a shift). The cost is one
    ReduceMean and one Sub per layer norm and their gradients. A mean output that a later
    node reads is the ReduceMean's. (The TorchScript frontend writes the same
    kernel for a layer norm of static shape: ``symbolics.normalization``.)
    """
    graph = model.graph
    norms = [
        i
        for i, n in enumerate(graph.node)
        if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")
    ]
    if not norms:
        return
    types, ranks = _elem_types(model), _ranks(model)
    if any(
        graph.node[i].input[0] not in types or graph.node[i].input[0] not in ranks for i in norms
    ):
        inferred = onnx.shape_inference.infer_shapes(model)
        types.update(_elem_types(inferred))
        ranks.update(_ranks(inferred))
    read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        x = node.input[0] if index in norms else ""
        if not x or types.get(x) != onnx.TensorProto.FLOAT:
            # float64 is computed in float64, float16/bfloat16 in float32 (stash_type): the
            # cancellation stays below their own rounding
            new_nodes.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        rank = ranks.get(x)
        if axis < 0:
            axes = list(range(axis, 0))
        elif rank is not None:
            axes = list(range(axis, rank))
        else:
            raise ExportError(
                f"the torch_export graph's LayerNormalization {node.name} has an input of "
                "unknown rank; use ORTMODULE_EXPORTER=torchscript"
            )
        tag = f"{node.name or 'LayerNormalization'}_{index}"
        mean, centered = f"{tag}_input_mean", f"{tag}_centered"
        new_nodes += [
            h.make_node(
                "Constant",
                [],
                [f"{tag}_mean_axes"],
                value=h.make_tensor(f"{tag}_mean_axes", onnx.TensorProto.INT64, [len(axes)], axes),
            ),
            h.make_node("ReduceMean", [x, f"{tag}_mean_axes"], [mean], keepdims=1),
            h.make_node("Sub", [x, mean], [centered]),
            node,
        ]
        node.input[0] = centered
        if len(node.output) > 1 and node.output[1] in read:
            # the input's mean is the mean output: read from the ReduceMean, it also has a
            # gradient (the engine's LayerNormalizationGrad reads none for it)
            saved = node.output[1]
            node.output[1] = f"{tag}_centered_mean"
            new_nodes.append(h.make_node("Identity", [mean], [saved]))
    del graph.node[:]
    graph.node.extend(new_nodes)


def _max_pool_values_gathered(model: onnx.ModelProto) -> None:
    """MaxPool picks the indices only; its values are gathered from the flattened input.

    The engine's CPU MaxPoolGrad (1.19.2) sizes its output from the node's static shape, so
    with dynamic dims it writes out of bounds (a segmentation fault); Gather's gradient
    scatters back instead. The same workaround as the TorchScript symbolic
    (``symbolics.pooling``), here on the graph.
    """
    graph = model.graph
    new_nodes: list[onnx.NodeProto] = []
    h = onnx.helper
    for index, node in enumerate(graph.node):
        new_nodes.append(node)
        if node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx") or not node.output[0]:
            continue
        values = node.output[0]
        tag = f"{node.name or 'MaxPool'}_{index}"
        node.output[0] = f"{tag}_unused_values"
        flat_shape = f"{tag}_minus_one"
        flat = f"{tag}_flat_input"
        new_nodes += [
            h.make_node(
                "Constant",
                [],
                [flat_shape],
                value=h.make_tensor(flat_shape, onnx.TensorProto.INT64, [1], [-1]),
            ),
            h.make_node("Reshape", [node.input[0], flat_shape], [flat]),
            h.make_node("Gather", [flat, node.output[1]], [values], axis=0),
        ]
    del graph.node[:]
    graph.node.extend(new_nodes)


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in (*graph.input, *graph.value_info, *graph.output)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    ranks.update({init.name: len(init.dims) for init in graph.initializer})
    return ranks


def _ranks_of(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, int]:
    """The ranks the graph declares, with ONNX shape inference's where one of ``names`` has
    none declared (inference runs over the whole model: only when needed)."""
    ranks = _ranks(model)
    if any(name not in ranks for name in names):
        ranks.update(_ranks(onnx.shape_inference.infer_shapes(model)))
    return ranks


def _matmul_vectors_as_matrices(model: onnx.ModelProto) -> None:
    """A 1-D operand of ``MatMul`` made a matrix of one row (left) or one column (right),
    the product's extra dim squeezed out again.

    The engine's MatMul gradient (1.19.2) mishandles a 1-D operand: for ``matmul(v, x)`` with
    ``x`` of rank 3 or more it multiplies the (..., n) output gradient by ``x``'s transpose
    as if both were matrices and sums, so ``v``'s gradient came back several units off, with
    the wrong sign (the fuzzer's seed 37); with ``x`` needing a gradient too, or a 1-D right
    operand, its FusedMatMul fails to broadcast. The TorchScript frontend does the same for a
    1-D left operand (``symbolics.matmul``); torch_lib writes ``MatMul`` as it is.
    """
    graph = model.graph

    def is_matmul(node: onnx.NodeProto) -> bool:
        return node.op_type == "MatMul" and node.domain in ("", "ai.onnx")

    matmuls = [n for n in graph.node if is_matmul(n)]
    if not matmuls:
        return
    ranks = _ranks_of(model, [i for n in matmuls for i in n.input])
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        left, right = (ranks.get(i) for i in node.input[:2]) if is_matmul(node) else (0, 0)
        if left is None or right is None:
            raise ExportError(
                f"the torch_export graph's MatMul {node.name} has an operand of unknown rank: "
                "the engine's gradient is wrong for a 1-D one; use ORTMODULE_EXPORTER=torchscript"
            )
        if left != 1 and right != 1:
            new_nodes.append(node)
            continue
        tag = f"{node.name or 'MatMul'}_{index}"
        inputs, squeezed = list(node.input), []
        for slot, axis in ((0, 0), (1, -1)):
            if (left, right)[slot] != 1:
                continue
            axes, out = f"{tag}_axes{slot}", f"{tag}_matrix{slot}"
            new_nodes += [
                h.make_node(
                    "Constant",
                    [],
                    [axes],
                    value=h.make_tensor(axes, onnx.TensorProto.INT64, [1], [axis]),
                ),
                h.make_node("Unsqueeze", [inputs[slot], axes], [out]),
            ]
            inputs[slot] = out
            # the product's row (left) / column (right) dim: -2 / -1 of the matrix product
            squeezed.append(-2 if slot == 0 else -1)
        product = f"{tag}_product"
        axes = f"{tag}_squeeze_axes"
        new_nodes += [
            h.make_node("MatMul", inputs, [product], name=node.name),
            h.make_node(
                "Constant",
                [],
                [axes],
                value=h.make_tensor(axes, onnx.TensorProto.INT64, [len(squeezed)], squeezed),
            ),
            h.make_node("Squeeze", [product, axes], [node.output[0]]),
        ]
    del graph.node[:]
    graph.node.extend(new_nodes)


def _scatter_add_onto_zeros(model: onnx.ModelProto) -> None:
    """``ScatterND``/``ScatterElements(data, indices, updates, reduction="add")`` ->
    ``data + Scatter(zeros, indices, updates, reduction="add")``.

    The engine's gradient of a scatter (1.19.2) ignores its reduction: it gives ``data`` the
    output gradient with the scattered positions zeroed, right when they are overwritten and
    wrong when added to (``index_add``, ``index_put(accumulate=True)``, ``scatter_add``: the
    input's gradient was 0 where eager's is the output's). Scattered onto zeros and added,
    ``data`` takes the gradient of ``Add`` (all of it), ``updates`` the gathered one, as
    before.
    """
    graph = model.graph

    def is_add(node: onnx.NodeProto) -> bool:
        return (
            node.op_type in ("ScatterND", "ScatterElements")
            and node.domain in ("", "ai.onnx")
            and any(a.name == "reduction" and a.s == b"add" for a in node.attribute)
        )

    if not any(is_add(n) for n in graph.node):
        return
    types = _elem_types(model)
    if any(is_add(n) and n.input[0] not in types for n in graph.node):
        types.update(_elem_types(onnx.shape_inference.infer_shapes(model)))
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if not is_add(node):
            new_nodes.append(node)
            continue
        data, out = node.input[0], node.output[0]
        dtype = types.get(data, 0)
        if not dtype:
            raise ExportError(
                f"the torch_export graph's {node.op_type} {node.name} adds into a tensor of "
                "unknown type; the engine's gradient of it is wrong: use "
                "ORTMODULE_EXPORTER=torchscript"
            )
        tag = f"{node.name or node.op_type}_{index}"
        new_nodes += _zeros_like(data, f"{tag}_zeros", dtype)
        node.input[0] = f"{tag}_zeros"
        node.output[0] = f"{tag}_added"
        new_nodes += [node, h.make_node("Add", [data, f"{tag}_added"], [out])]
    del graph.node[:]
    graph.node.extend(new_nodes)


def _as_vector(node: onnx.NodeProto, slot: int, tag: str, axes: str) -> list[onnx.NodeProto]:
    """Nodes making ``node``'s input ``slot`` (a 0-d tensor) 1-D: the node reads
    ``{tag}_vector`` from then on."""
    h = onnx.helper
    vector = f"{tag}_vector"
    made = [
        h.make_node(
            "Constant", [], [axes], value=h.make_tensor(axes, onnx.TensorProto.INT64, [1], [0])
        ),
        h.make_node("Unsqueeze", [node.input[slot], axes], [vector]),
    ]
    node.input[slot] = vector
    return made


def _zeros_like(like: str, out: str, dtype: int) -> list[onnx.NodeProto]:
    """Nodes writing ``out``: zeros of ``like``'s shape and element type ``dtype``."""
    h = onnx.helper
    return [
        h.make_node("Shape", [like], [f"{out}_shape"]),
        h.make_node(
            "ConstantOfShape",
            [f"{out}_shape"],
            [out],
            value=h.make_tensor(f"{out}_zero", dtype, [1], [0]),
        ),
    ]


def _cast_like_as_cast(model: onnx.ModelProto) -> None:
    """``CastLike(x, like)`` -> ``Cast(x, to=like's type)``: the engine (1.19.2) has no gradient
    for CastLike; torch_lib writes one for nearly every Python scalar it combines with a tensor."""
    if not any(n.op_type == "CastLike" for n in model.graph.node):
        return
    types = _elem_types(model)
    missing = [
        n.input[1] for n in model.graph.node if n.op_type == "CastLike" and n.input[1] not in types
    ]
    if missing:
        inferred = onnx.shape_inference.infer_shapes(model)
        types.update(_elem_types(inferred))
    for node in model.graph.node:
        if node.op_type != "CastLike":
            continue
        to = types.get(node.input[1], 0)
        if not to:
            raise ExportError(
                f"the torch_export graph has a CastLike ({node.name}) to a type not known "
                "before the run; the engine cannot differentiate it"
            )
        del node.input[1:]
        node.op_type = "Cast"
        node.attribute.append(onnx.helper.make_attribute("to", to))


def _is_default(node: onnx.NodeProto, *op_types: str) -> bool:
    return node.op_type in op_types and node.domain in ("", "ai.onnx")


def _pow_exponent_as_base_type(model: onnx.ModelProto) -> None:
    """``Pow(x, n)`` with an integer ``n`` and a float ``x``: ``n`` cast to ``x``'s type.

    ONNX lets the exponent's type differ; the engine's Pow gradient (1.19.2) computes
    ``n - 1`` against float constants and fails to build ("Type parameter (T) of Optype (Sub)
    bound to different types"). torch_lib writes ``x ** 2`` with an int64 2 (``special.erfcx``);
    the TorchScript exporter a float one. An integer exponent is exact in float.
    """
    graph = model.graph
    pows = [n for n in graph.node if _is_default(n, "Pow")]
    if not pows:
        return
    types = _elem_types(model)
    if any(i not in types for n in pows for i in n.input[:2]):
        types.update(_elem_types(onnx.shape_inference.infer_shapes(model)))
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16)  # fmt: skip
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if node in pows:
            base, exponent = (types.get(i, 0) for i in node.input[:2])
            if base in floats and exponent and exponent != base:
                cast = f"{node.name or 'Pow'}_{index}_exponent"
                new_nodes.append(onnx.helper.make_node("Cast", [node.input[1]], [cast], to=base))
                node.input[1] = cast
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


#: ONNX op -> its inputs that must be at least 1-D: where the first is 0-d, the op runs on
#: those of them that are 0-d made 1-D (axis 0), and its outputs are squeezed back
_VECTOR_OPERANDS = {
    # TopK needs rank 1 or more; the engine's shape inference refused the graph ("Invalid
    # value for attribute axis"); torch.topk of a 0-d tensor (k = 1) is the tensor, index 0
    "TopK": (0,),
    # data, indices and updates share a rank; the CPU kernel refused rank 0 at run time
    # ("axis 0 is not in valid range [-0,-1]"; scatter/scatter_add of 0-d tensors)
    "ScatterElements": (0, 1, 2),
    "GatherElements": (0, 1),
}


def _scalar_operands_as_vectors(model: onnx.ModelProto) -> None:
    """Each op of :data:`_VECTOR_OPERANDS` on 0-d operands runs on them made 1-D, its outputs
    squeezed back; a ``Tile`` of a 0-d tensor (its repeats empty: their length is the rank) is
    an Identity: the CPU kernel refused it ("must be atleast 1 dimensional")."""
    graph = model.graph
    found = [n for n in graph.node if _is_default(n, "Tile", *_VECTOR_OPERANDS)]
    if not found:
        return
    ranks = _ranks_of(model, [n.input[0] for n in found])
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if node not in found or ranks.get(node.input[0]) != 0:
            new_nodes.append(node)
            continue
        if node.op_type == "Tile":
            node.op_type = "Identity"
            del node.input[1:]
            new_nodes.append(node)
            continue
        tag = f"{node.name or node.op_type}_{index}"
        axes = f"{tag}_axes"
        slots = [s for s in _VECTOR_OPERANDS[node.op_type] if ranks.get(node.input[s]) == 0]
        for n, slot in enumerate(slots):
            made = _as_vector(node, slot, f"{tag}_{slot}", axes)
            new_nodes += made if n == 0 else made[1:]  # one Constant of the axes
        for attr in node.attribute:
            if attr.name == "axis":
                attr.i = 0
        new_nodes.append(node)
        for slot, out in enumerate(node.output):
            if out:
                node.output[slot] = f"{tag}_out{slot}"
                new_nodes.append(h.make_node("Squeeze", [node.output[slot], axes], [out]))
    del graph.node[:]
    graph.node.extend(new_nodes)


def _reductions_of_scalars(model: onnx.ModelProto) -> None:
    """A reduction of a 0-d tensor over given axes reduces it made 1-D over axis 0, without
    keeping dims: a 0-d result, as PyTorch's.

    PyTorch takes dim 0 (or -1) of a 0-d tensor (``normalize(x, dim=0)``, ``x.sum(0)``), and
    torch_lib passes it on as the axes; ONNX allows none for rank 0, and the engine's shape
    inference refuses the graph ("axis must be in [-rank, rank-1]. input rank was 0"). Axes
    computed in the graph stay unread: with ``noop_with_empty_axes=0`` (torch_lib's) any axes of
    a 0-d tensor, empty ones too, reduce its one element. With ``noop_with_empty_axes=1``
    only a constant, non-empty axes is rewritten (empty ones are the identity).
    """
    graph = model.graph
    found = [n for n in graph.node if _is_default(n, *onnx_graph.REDUCTIONS) and _has_axes(n)]
    if not found:
        return
    ranks = _ranks_of(model, [n.input[0] for n in found])
    values = onnx_graph.constant_values(graph)
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if node not in found or ranks.get(node.input[0]) != 0:
            new_nodes.append(node)
            continue
        if onnx_graph.attribute(node, "noop_with_empty_axes", 0):
            axes = values.get(node.input[1]) if len(node.input) > 1 else None
            if axes is None or axes.size == 0:
                new_nodes.append(node)
                continue
        tag = f"{node.name or node.op_type}_{index}"
        zero = f"{tag}_axis0"
        new_nodes += _as_vector(node, 0, tag, zero)
        if len(node.input) > 1:
            node.input[1] = zero
        kept = [a for a in node.attribute if a.name not in ("keepdims", "axes")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(h.make_attribute("keepdims", 0))
        if not (len(node.input) > 1 and node.input[1]):
            node.attribute.append(h.make_attribute("axes", [0]))  # the attribute form (opset < 18)
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


def _has_axes(node: onnx.NodeProto) -> bool:
    """Whether a reduction is given axes (an input, or the attribute of older opsets)."""
    return (len(node.input) > 1 and bool(node.input[1])) or any(
        a.name == "axes" and len(a.ints) for a in node.attribute
    )


def _reversed_slices_as_gathers(model: onnx.ModelProto) -> None:
    """A ``Slice`` with a negative step (torch_lib's ``flip``) on a float tensor: each such
    axis a ``Gather`` of the indices ``Range(start, end, step)``, clamped as Slice clamps them;
    the axes with a positive step stay a Slice.

    The engine's SliceGrad (1.19.2) fails on a negative step (``narrowing_error``; the
    TorchScript frontend runs ``flip`` in PyTorch, ``aten/gradient_gaps.py``); Gather's
    gradient scatters back. Steps, starts, ends and axes must be constants (torch_lib's are);
    otherwise the Slice stays and the engine's error names it.
    """
    graph = model.graph
    slices = [n for n in graph.node if _is_default(n, "Slice") and len(n.input) > 4]
    if not slices:
        return
    values = onnx_graph.constant_values(graph)
    types = _elem_types(model)
    h = onnx.helper
    i64 = onnx.TensorProto.INT64

    def const(name: str, value: list[int]) -> onnx.NodeProto:
        return h.make_node("Constant", [], [name], value=h.make_tensor(name, i64, [], value))

    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        found = [values.get(i) for i in node.input[1:5]] if node in slices else [None]
        parts = [p for p in found if p is not None]
        if len(parts) != 4 or not any(int(v) < 0 for v in parts[3].ravel()):
            new_nodes.append(node)
            continue
        if types.get(node.input[0], onnx.TensorProto.FLOAT) not in onnx_graph.FLOAT_TYPES:
            new_nodes.append(node)  # no gradient: the engine's Slice kernel is right
            continue
        starts, ends, axes, steps = (p.ravel().tolist() for p in parts)
        tag = f"{node.name or 'Slice'}_{index}"
        x, out = node.input[0], node.output[0]
        forward = [k for k, step in enumerate(steps) if step > 0]
        if forward:
            kept = f"{tag}_forward"
            for j, name in enumerate(("starts", "ends", "axes", "steps")):
                vals = [(starts, ends, axes, steps)[j][k] for k in forward]
                new_nodes.append(
                    h.make_node(
                        "Constant",
                        [],
                        [f"{tag}_{name}"],
                        value=h.make_tensor(f"{tag}_{name}", i64, [len(vals)], vals),
                    )
                )
            new_nodes.append(
                h.make_node(
                    "Slice",
                    [x, *(f"{tag}_{n}" for n in ("starts", "ends", "axes", "steps"))],
                    [kept],
                    name=node.name,
                )
            )
            x = kept
        backward = [k for k, step in enumerate(steps) if step < 0]
        new_nodes += [h.make_node("Shape", [x], [f"{tag}_shape"])]
        for n, k in enumerate(backward):
            t = f"{tag}_axis{n}"
            dim = f"{t}_dim"
            new_nodes += [
                const(f"{t}_axis", [axes[k]]),
                h.make_node("Gather", [f"{tag}_shape", f"{t}_axis"], [dim], axis=0),
                const(f"{t}_zero", [0]),
                const(f"{t}_minus_one", [-1]),
                h.make_node("Add", [dim, f"{t}_minus_one"], [f"{t}_last"]),
            ]
            # ONNX Slice, negative step: a negative start/end counts from the end, then the
            # start is clamped to [0, dim - 1] and the end to [-1, dim - 1]
            for which, value, low in (("start", starts[k], "zero"), ("end", ends[k], "minus_one")):
                v = f"{t}_{which}"
                if which == "end" and value <= -(2**62):
                    new_nodes.append(const(f"{t}_end_clamped", [-1]))  # torch_lib's INT64_MIN
                    continue
                new_nodes.append(const(v, [value]))
                if value < 0:
                    new_nodes.append(h.make_node("Add", [v, dim], [f"{v}_from_end"]))
                    v = f"{v}_from_end"
                new_nodes += [
                    h.make_node("Min", [v, f"{t}_last"], [f"{v}_low"]),
                    h.make_node("Max", [f"{v}_low", f"{t}_{low}"], [f"{t}_{which}_clamped"]),
                ]
            # indices start + step * [0, count): not Range(start, end, step) itself, which the
            # engine's optimizer (GatherToSlice fusion) turns back into a Slice, wrongly
            stride = -steps[k]
            new_nodes += [
                h.make_node("Sub", [f"{t}_start_clamped", f"{t}_end_clamped"], [f"{t}_span"]),
                h.make_node("Max", [f"{t}_span", f"{t}_zero"], [f"{t}_length"]),
                const(f"{t}_round", [stride - 1]),
                const(f"{t}_stride", [stride]),
                h.make_node("Add", [f"{t}_length", f"{t}_round"], [f"{t}_rounded"]),
                h.make_node("Div", [f"{t}_rounded", f"{t}_stride"], [f"{t}_count"]),
                const(f"{t}_one", [1]),
                h.make_node("Range", [f"{t}_zero", f"{t}_count", f"{t}_one"], [f"{t}_steps"]),
                h.make_node("Mul", [f"{t}_steps", f"{t}_stride"], [f"{t}_offsets"]),
                h.make_node("Sub", [f"{t}_start_clamped", f"{t}_offsets"], [f"{t}_indices"]),
                h.make_node(
                    "Gather",
                    [x, f"{t}_indices"],
                    [out if n == len(backward) - 1 else f"{t}_out"],
                    axis=axes[k],
                ),
            ]
            x = f"{t}_out"
    del graph.node[:]
    graph.node.extend(new_nodes)


def _l2_norms_by_sums(model: onnx.ModelProto) -> None:
    """``ReduceL2(x)`` -> ``Where(s == 0, 0, Sqrt(Where(s == 0, 1, s)))``, ``s`` the
    ``ReduceSum`` of ``x * x`` (same axes and keepdims).

    The engine's ReduceL2 gradient graph (1.19.2) leaves a value untyped and the build fails
    ("does not have type information set by parent node"; ``dist``, ``norm``; the TorchScript
    frontend runs it in PyTorch, ``aten/gradient_gaps.py``). The ``Where`` pair gives a zero
    norm the gradient 0, as PyTorch's norm backward does, where ``Sqrt``'s would be NaN.
    """
    graph = model.graph
    if not any(_is_default(n, "ReduceL2") for n in graph.node):
        return
    types = _elem_types(model)
    if any(_is_default(n, "ReduceL2") and n.input[0] not in types for n in graph.node):
        types.update(_elem_types(onnx.shape_inference.infer_shapes(model)))
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        dtype = types.get(node.input[0], 0) if _is_default(node, "ReduceL2") else 0
        if not dtype:
            new_nodes.append(node)
            continue
        tag = f"{node.name or 'ReduceL2'}_{index}"
        x, out = node.input[0], node.output[0]
        node.op_type = "ReduceSum"
        node.input[0] = f"{tag}_squares"
        node.output[0] = sums = f"{tag}_sums"
        zero, one = f"{tag}_zero", f"{tag}_one"
        new_nodes += [
            h.make_node("Mul", [x, x], [f"{tag}_squares"]),
            node,
            h.make_node("Constant", [], [zero], value=h.make_tensor(zero, dtype, [], [0.0])),
            h.make_node("Constant", [], [one], value=h.make_tensor(one, dtype, [], [1.0])),
            h.make_node("Equal", [sums, zero], [f"{tag}_is_zero"]),
            h.make_node("Where", [f"{tag}_is_zero", one, sums], [f"{tag}_safe"]),
            h.make_node("Sqrt", [f"{tag}_safe"], [f"{tag}_root"]),
            h.make_node("Where", [f"{tag}_is_zero", zero, f"{tag}_root"], [out]),
        ]
    del graph.node[:]
    graph.node.extend(new_nodes)


#: elementwise ops whose inputs share one type in ONNX
_SAME_TYPE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Min", "Max"})


def _integer_operands_as_float(model: onnx.ModelProto) -> None:
    """An integer operand of ``Add``/``Sub``/``Mul``/``Div``/``Min``/``Max`` whose other operand is
    float: cast to that float type, PyTorch's promotion.

    torch_lib leaves some of ATen's mixed arithmetic as it is (``masked.std`` divides a float sum
    by an int64 count: ``Div(float, int64)``), which ONNX does not allow; the engine refuses the
    graph ("Type parameter (T) of Optype (Div) bound to different types").
    """
    graph = model.graph
    ops = [n for n in graph.node if _is_default(n, *_SAME_TYPE_OPS) and len(n.input) == 2]
    if not ops:
        return
    types = _elem_types(model)
    if any(i not in types for n in ops for i in n.input):
        types.update(_elem_types(onnx.shape_inference.infer_shapes(model)))
    floats = onnx_graph.FLOAT_TYPES
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        kinds = [types.get(i, 0) for i in node.input] if node in ops else []
        float_type = next((k for k in kinds if k in floats), 0)
        if float_type and all(kinds):
            for slot, kind in enumerate(kinds):
                if kind not in floats:
                    cast = f"{node.name or node.op_type}_{index}_as_float{slot}"
                    new_nodes.append(
                        onnx.helper.make_node("Cast", [node.input[slot]], [cast], to=float_type)
                    )
                    node.input[slot] = cast
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


_FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
)


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Each typed value's shape: a dim's value, its symbol, or None where unknown."""
    graph = model.graph
    return {
        vi.name: [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in vi.type.tensor_type.shape.dim
        ]
        for vi in (*graph.input, *graph.value_info, *graph.output)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }


def _where_branches_expanded(model: onnx.ModelProto) -> None:
    """A float branch of ``Where`` that may be smaller than the output is expanded to it.

    The engine's gradient of ``Where`` (1.19.2) is ``Where(cond, dY, 0)`` for each branch, in
    the output's shape: it never sums back over the dims a branch was broadcast along. T5's
    relative position bias ``(1, heads, q, k)`` under a ``(batch, 1, q, k)`` padding mask got
    a ``(batch, heads, q, k)`` gradient, and the backward failed further up (HF umt5). An
    ``Expand`` to the output's shape first gives the branch a gradient of its own shape
    (``Expand``'s gradient reduces). A branch that is a constant, or whose known shape is the
    output's without a dim of 1, is left as it is. The TorchScript frontend does the same in
    its ``where`` symbolic (``symbolics/mask.py``).
    """
    graph = model.graph
    if not any(n.op_type == "Where" for n in graph.node):
        return
    types = _elem_types(model)
    shapes = _shapes(model)
    constant = {init.name for init in graph.initializer}
    constant.update(o for n in graph.node if n.op_type == "Constant" for o in n.output)

    def smaller(branch: str, out: str) -> bool:
        if not branch or branch in constant or types.get(branch) not in _FLOAT_TYPES:
            return False
        have, want = shapes.get(branch), shapes.get(out)
        if have is None or want is None:
            return True
        return have != want or any(d is None or d == 1 for d in have)

    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        branches = []
        if node.op_type == "Where" and node.domain in ("", "ai.onnx"):
            branches = [slot for slot in (1, 2) if smaller(node.input[slot], node.output[0])]
        if not branches:
            new_nodes.append(node)
            continue
        tag = f"{node.name or 'Where'}_{index}_expanded"
        # the output's shape from a copy of the node: Shape has no gradient
        new_nodes.append(onnx.helper.make_node("Where", list(node.input), [f"{tag}_probe"]))
        new_nodes.append(onnx.helper.make_node("Shape", [f"{tag}_probe"], [f"{tag}_shape"]))
        for slot in branches:
            wide = f"{tag}_{slot}"
            new_nodes.append(
                onnx.helper.make_node("Expand", [node.input[slot], f"{tag}_shape"], [wide])
            )
            node.input[slot] = wide
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


def _stop_gradient_copy(x: str, out: str, dtype: int, tag: str) -> list[onnx.NodeProto]:
    """``out``: ``x``'s value with no gradient path back, as the engine builds no backward for:
    the ``BatchNormalization`` trick for float32 and float16 (its CPU kernels' types), the
    internal ATen copy whose input is a registered stop-gradient edge otherwise."""
    if dtype in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        return _batch_norm_copy(x, out, dtype, tag)
    return [
        onnx.helper.make_node(
            "ATen",
            [x],
            [out],
            name=tag,
            domain=ATEN_DOMAIN,
            operator=ATEN_STOP_GRADIENT,
            overload_name="",
        )
    ]


def _stop_gradients_as_engine_cuts(model: onnx.ModelProto) -> None:
    """Each ``ortmodule::stop_gradient`` node (the cuts of ``torch_export_grad_cuts``, which the
    translator writes as an ATen node of that custom operator) becomes a copy the engine never
    differentiates (:func:`_stop_gradient_copy`).

    Left as it was, the node ran as a PythonOp with a PythonOpGrad that handed back no
    gradient: a weight reached only through a cut (a ``Linear`` read under ``no_grad`` whose
    result feeds the loss) got zeros instead of None, and with a float64 value on that path
    the engine crashed the process while creating the session (1.19.2, a segmentation fault).
    """
    graph = model.graph
    types = _elem_types(model)
    nodes: list[onnx.NodeProto] = []
    for k, node in enumerate(graph.node):
        if not (
            node.domain == ATEN_DOMAIN
            and node.op_type == "ATen"
            and onnx_graph.attribute(node, "operator", "") == STOP_GRADIENT
        ):
            nodes.append(node)
            continue
        x, out = node.input[0], node.output[0]
        nodes.extend(_stop_gradient_copy(x, out, types.get(x, 0), f"{node.name or out}_cut{k}"))
    del graph.node[:]
    graph.node.extend(nodes)


def cut_gradients_of_outputs(model: onnx.ModelProto, names: Sequence[str]) -> None:
    """Each graph output of ``names`` becomes a stop-gradient copy of its value; the graph's
    other reads of the value keep their gradient.

    For the float outputs that eager computes without grad though from a trainable input
    (``native_layer_norm``'s mean and rstd; its derivative declares them non-differentiable).
    The engine (1.19.2) sees a path from a trainable input to them, so takes them for
    differentiable outputs and asks for their gradient; where no gradient builder reads one
    (LayerNormalizationGrad reads none for the inverse standard deviation), the build fails
    ("Differentiable param grad node arg should exist"). Cut, they are outputs without a
    gradient for the engine as they are for eager. The TorchScript frontend cuts the same way
    (``gradient_cuts.py``): the ``BatchNormalization`` trick for float32 and float16, the
    ATen copy otherwise.
    """
    graph = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in graph.output}
    producer = {o: n for n in graph.node for o in n.output if o}
    count = Counter(vi.name for vi in graph.output)
    for k, name in enumerate(names):
        dtype = types.get(name, 0)
        if name not in producer or dtype not in onnx_graph.FLOAT_TYPES or count[name] > 1:
            # a value output twice may be another output's too, one that needs its gradient
            continue
        tag = f"{name}_stop_gradient{k}"
        value = f"{tag}_value"
        onnx_graph.rename_values(graph, {name: value})
        # the graph output keeps its name: it is written by the copy below
        for vi in graph.output:
            if vi.name == value:
                vi.name = name
        graph.node.extend(_stop_gradient_copy(value, name, dtype, tag))


def _batch_norm_copy(x: str, out: str, dtype: int, tag: str) -> list[onnx.NodeProto]:
    """``out``: ``x``'s value with no gradient path back (``symbolics.helpers._stop_gradient``:
    the engine never differentiates BatchNormalization through its running-mean input, and a
    training-mode node with momentum 1 hands that input back as its new running mean)."""
    h = onnx.helper
    i64 = onnx.TensorProto.INT64

    def filled(shape: str, value: float, name: str) -> onnx.NodeProto:
        return h.make_node(
            "ConstantOfShape",
            [shape],
            [name],
            value=h.make_tensor(f"{name}_v", dtype, [1], [value]),
        )

    flat, n, rows = f"{tag}_flat", f"{tag}_n", f"{tag}_rows"
    return [
        h.make_node(
            "Constant", [], [f"{tag}_minus_one"], value=h.make_tensor(f"{tag}_m", i64, [1], [-1])
        ),
        h.make_node("Reshape", [x, f"{tag}_minus_one"], [flat]),
        h.make_node("Shape", [flat], [n]),
        # two zero rows: a one-row batch has no variance, which some kernels reject
        h.make_node("Constant", [], [f"{tag}_two"], value=h.make_tensor(f"{tag}_t", i64, [1], [2])),
        h.make_node("Concat", [f"{tag}_two", n], [rows], axis=0),
        filled(rows, 0.0, f"{tag}_zeros_x"),
        filled(n, 1.0, f"{tag}_ones"),
        filled(n, 0.0, f"{tag}_zeros"),
        h.make_node(
            "BatchNormalization",
            [f"{tag}_zeros_x", f"{tag}_ones", f"{tag}_zeros", flat, f"{tag}_ones"],
            [f"{tag}_y", f"{tag}_running_mean", f"{tag}_running_var"],
            epsilon=1e-5,
            momentum=1.0,
            training_mode=1,
        ),
        h.make_node("Shape", [x], [f"{tag}_shape"]),
        h.make_node("Reshape", [f"{tag}_running_mean", f"{tag}_shape"], [out]),
    ]
