"""The ``torch_export`` frontend (``ORTMODULE_EXPORTER=torch_export``): ``torch.export`` + the
dynamo ONNX translator, giving the same graph interface as the TorchScript frontend.

1. ``torch.export.export`` (non-strict) captures the flat wrapper (:class:`TorchExportFlat`) in
   the module's own training mode, batch and sequence dims (every dim of every input, unless
   ``static_shapes``) as ``Dim.AUTO``: shapes stay symbolic (no ``Reshape`` to a traced size),
   a branch on a tensor's value is refused with PyTorch's data-dependent error, and the
   in-place writes to buffers and inputs are functionalized (the wrapper returns their new
   values as outputs, named as the TorchScript frontend names them).
2. ``torch.onnx.export(program, dynamo=True)`` translates the ATen graph to ONNX with
   onnxscript's torch_lib, with our translations where torch_lib's are inference-only
   (:data:`TRAINING_TRANSLATIONS`), without its optimizer (it constant-folds initializers,
   which here are the trained parameters).
3. The result is put in the TorchScript frontend's shape: local functions inlined, parameters
   and buffers as graph inputs without data named by their qualified names, user inputs named
   from their pytree paths, outputs by position.

Why not an FX -> ONNX lowering of our own: torch_lib already lowers every core ATen operator
(hundreds, with their dtype and broadcast rules); ours would start from zero and diverge. Its
training gaps are few and local, and a custom translation closes each (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference
import torch

from ortmodule_pytree import Schema, flatten, unflatten

from .. import onnx_graph
from ..errors import ExportError
from .calls import call_bound, writable_buffers
from .guards import Guard
from .model import BUFFER_WRITE_PREFIX, INPUT_WRITE_PREFIX
from .shape_guards import Dim, ShapeGuard, _Step

logger = logging.getLogger("ortmodule.exporter")

#: the opset the dynamo translator writes: torch_lib's functions are written for opset 18 and
#: newer, and the engine (1.19.2) runs and differentiates up to 21
TORCH_EXPORT_MIN_OPSET = 18


@dataclass
class _Found:
    """What the wrapper's forward found out while torch.export ran it."""

    output_schema: Schema | None = None
    output_error: TypeError | None = None
    written_inputs: list[int] = field(default_factory=list)
    written_buffers: list[str] = field(default_factory=list)
    #: the torch.autograd.Function subclasses the forward applied, by qualified name
    functions: list[str] = field(default_factory=list)


class TorchExportFlat(torch.nn.Module):
    """Flat tensors in, flat tensors out, for ``torch.export``: the user's outputs, then the new
    values of the inputs and buffers the forward wrote in place (found from their version
    counters, which functionalization keeps moving under export)."""

    def __init__(self, module: torch.nn.Module, input_schema: Schema, wrapped_name: str) -> None:
        super().__init__()
        self._wrapped_name = wrapped_name
        setattr(self, wrapped_name, module)
        self._input_schema = input_schema
        # torch.export puts back the module attributes a forward assigns: what the forward
        # finds is kept in this record, which it changes but never replaces
        self._found = _Found()
        # what the TorchScript wrapper also reports: export runs on fake tensors (no traced
        # values to keep for constant outputs) and refuses data-dependent Python (no guards)
        self.traced_outputs: tuple[torch.Tensor, ...] = ()
        self.guards: list[Any] = []
        #: what torch.export assumed of the input sizes (:func:`size_guards`), set after export
        self.shape_guards: list[ShapeGuard] = []

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arguments = unflatten(list(flat), self._input_schema)
        module = getattr(self, self._wrapped_name)
        buffers = writable_buffers(module)
        input_versions = [t._version for t in flat]
        buffer_versions = {name: b._version for name, b in buffers.items()}
        with _recording_functions(self._found.functions):
            out = call_bound(module, arguments)
        try:
            tensors, schema = flatten(out, prefix="output")
        except TypeError as err:
            self._found.output_error = err
            raise
        found = self._found
        found.output_schema = schema
        found.written_inputs = [i for i, t in enumerate(flat) if t._version != input_versions[i]]
        found.written_buffers = [n for n, b in buffers.items() if b._version != buffer_versions[n]]
        written = [flat[i] for i in found.written_inputs] + [
            buffers[n] for n in found.written_buffers
        ]
        # a returned buffer or input is a view of the state export lifts: a clone keeps the
        # output a value of its own
        return (*tensors, *(w.clone() for w in written))

    @property
    def output_schema(self) -> Schema | None:
        return self._found.output_schema

    @property
    def output_error(self) -> TypeError | None:
        return self._found.output_error

    @property
    def written_inputs(self) -> list[int]:
        return self._found.written_inputs

    @property
    def written_buffers(self) -> list[str]:
        return self._found.written_buffers

    @property
    def functions(self) -> list[str]:
        return self._found.functions

    def extra_output_names(self) -> list[str]:
        """Names of the outputs after the user's, as the TorchScript frontend names them."""
        names = self._input_schema.names
        return [
            *(f"{INPUT_WRITE_PREFIX}{names[i]}" for i in self.written_inputs),
            *(f"{BUFFER_WRITE_PREFIX}{n}" for n in self.written_buffers),
        ]


# Functions whose backward is the derivative of their forward, recomputed: inlining them
# (what torch.export does with every Function) keeps the gradient
_INLINE_SAFE_FUNCTIONS = ("torch.utils.checkpoint.CheckpointFunction",)


@contextlib.contextmanager
def _recording_functions(seen: list[str]) -> Iterator[None]:
    """Record every ``torch.autograd.Function.apply`` while torch.export runs the forward.

    torch.export inlines a Function's forward and drops its backward: the engine would then
    differentiate the forward (a straight-through estimator's round() has a zero gradient),
    so the caller refuses the graph instead (:func:`export_program`).
    """
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name not in seen:
            seen.append(name)
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]


def _dynamic_shapes(tensors: Sequence[torch.Tensor], static_shapes: bool) -> Any:
    if static_shapes:
        return None
    auto = torch.export.Dim.AUTO
    # One entry per forward parameter: the wrapper's is ``*flat``, a tuple of all the tensors.
    # A zero-element tensor keeps its dims fixed: its shape is part of the input schema anyway
    # (ortmodule_pytree: another empty shape is another graph), and with symbolic dims the
    # empty outputs computed from it carry SymInts into the output schema, which cannot be
    # hashed when the run rebuilds the outputs ("unhashable type: non-nested SymInt").
    return (
        tuple(
            {i: auto for i in range(t.dim())} if t.dim() and t.numel() else None for t in tensors
        ),
    )


# -- training translations: where torch_lib lowers for inference only ---------------------------


def _batch_norm_training(opset: int) -> Any:
    """``_native_batch_norm_legit_functional`` as a training-mode ``BatchNormalization``.

    torch_lib 0.7 forces ``training = False`` (an ONNX Runtime limitation of old opsets), which
    normalises a training step with the running statistics: silently wrong. The engine's
    training-mode BatchNormalization uses the batch's and has a gradient; the BatchNorm pass
    (``passes.batchnorm``) takes its running-statistic outputs to the module's buffers as for
    the TorchScript frontend.
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it

    op = onnxscript.values.Opset("", opset)

    def batch_norm(
        input: Any,
        weight: Any = None,
        bias: Any = None,
        running_mean: Any = None,
        running_var: Any = None,
        training: bool = False,
        momentum: float = 0.9,
        eps: float = 1e-05,
    ) -> tuple[Any, Any, Any, Any, Any]:
        channels = op.Shape(input, start=1, end=2)
        if weight is None:
            weight = op.Expand(op.CastLike(op.Constant(value_float=1.0), input), channels)
        if bias is None:
            bias = op.Expand(op.CastLike(op.Constant(value_float=0.0), input), channels)
        rank = len(input.shape)
        axes = op.Constant(value_ints=[0, *range(2, rank)])
        if running_mean is None or running_var is None:
            raise ExportError(
                "BatchNorm without running statistics (track_running_stats=False) is not "
                "supported by ORTMODULE_EXPORTER=torch_export yet; use the torchscript frontend"
            )
        if not training:
            norm = op.BatchNormalization(
                input, weight, bias, running_mean, running_var, epsilon=eps, momentum=1.0 - momentum
            )
            save_mean = op.Identity(running_mean)
            save_rstd = op.Div(
                op.CastLike(op.Constant(value_float=1.0), running_var),
                op.Sqrt(
                    op.Add(running_var, op.CastLike(op.Constant(value_float=eps), running_var))
                ),
            )
            return norm, save_mean, save_rstd, op.Identity(running_mean), op.Identity(running_var)
        norm, new_mean, new_var = op.BatchNormalization(
            input,
            weight,
            bias,
            running_mean,
            running_var,
            epsilon=eps,
            momentum=1.0 - momentum,
            training_mode=1,
            _outputs=3,
        )
        save_mean = op.ReduceMean(input, axes, keepdims=0)
        centered = op.Sub(input, op.ReduceMean(input, axes, keepdims=1))
        var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=0)
        save_rstd = op.Div(
            op.CastLike(op.Constant(value_float=1.0), var),
            op.Sqrt(op.Add(var, op.CastLike(op.Constant(value_float=eps), var))),
        )
        return norm, save_mean, save_rstd, new_mean, new_var

    return batch_norm


def _splits(opset: int) -> tuple[Any, Any]:
    """``split`` and ``split_with_sizes`` as one ``Split`` with a fixed number of outputs.

    torch_lib writes ``SplitToSequence`` and reads parts with ``SequenceAt``; the engine's
    gradient builder has neither (1.19.2). The number of parts is known whenever the split
    dim's size is (sizes given, or a static dim); a dynamic one keeps torch_lib's lowering and
    the engine's error names the node.
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it

    op = onnxscript.values.Opset("", opset)

    def _static(sizes: Any) -> list[int] | None:
        if isinstance(sizes, int):
            return [sizes]
        if isinstance(sizes, (list, tuple)) and all(isinstance(v, int) for v in sizes):
            return list(sizes)
        return None

    def parts(self: Any, sizes: list[int], dim: int) -> Any:
        if len(set(sizes)) == 1:
            # the translator counts Split's outputs from num_outputs only
            return op.Split(self, axis=dim, num_outputs=len(sizes))
        out, start = [], 0
        for size in sizes:
            out.append(
                op.Slice(
                    self,
                    op.Constant(value_ints=[start]),
                    op.Constant(value_ints=[start + size]),
                    op.Constant(value_ints=[dim]),
                )
            )
            start += size
        return tuple(out)

    def split_with_sizes(self: Any, split_sizes: Any, dim: int = 0) -> Any:
        sizes = _static(split_sizes)
        if sizes is None:
            return op.SplitToSequence(self, split_sizes, axis=dim)
        return parts(self, sizes, dim)

    def split(self: Any, split_size: Any, dim: int = 0) -> Any:
        size = _static(split_size)
        rank = len(self.shape) if self.shape is not None else None
        total = self.shape[dim] if rank is not None else None
        if size is None or len(size) != 1 or not isinstance(total, int):
            return op.SplitToSequence(self, split_size, axis=dim)
        step = size[0]
        sizes = [step] * (total // step) + ([total % step] if total % step else [])
        return parts(self, sizes, dim)

    return split, split_with_sizes


def training_translations(opset: int) -> dict[Any, Any]:
    """ATen overload -> onnxscript function, for the ops whose torch_lib lowering is wrong in
    training or has no gradient in the engine."""
    split, split_with_sizes = _splits(opset)
    aten = torch.ops.aten
    return {
        aten._native_batch_norm_legit_functional.default: _batch_norm_training(opset),
        aten.split.Tensor: split,
        aten.split_with_sizes.default: split_with_sizes,
    }


# -- graph rewrites for the engine's gradient builder ------------------------------------------


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in (*graph.input, *graph.value_info, *graph.output)
        if vi.type.HasField("tensor_type")
    }
    types.update({init.name: init.data_type for init in graph.initializer})
    return types


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
    h = onnx.helper
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
            new_nodes += [
                h.make_node("Shape", [scale], [f"{tag}_bias_shape"]),
                h.make_node(
                    "ConstantOfShape",
                    [f"{tag}_bias_shape"],
                    [f"{tag}_zero_bias"],
                    value=h.make_tensor(f"{tag}_zero", dtype, [1], [0]),
                ),
            ]
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
    ranks = _ranks(model)
    if any(i not in ranks for n in matmuls for i in n.input):
        ranks.update(_ranks(onnx.shape_inference.infer_shapes(model)))
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
        new_nodes += [
            h.make_node("Shape", [data], [f"{tag}_data_shape"]),
            h.make_node(
                "ConstantOfShape",
                [f"{tag}_data_shape"],
                [f"{tag}_zeros"],
                value=h.make_tensor(f"{tag}_zero", dtype, [1], [0]),
            ),
        ]
        node.input[0] = f"{tag}_zeros"
        node.output[0] = f"{tag}_added"
        new_nodes += [node, h.make_node("Add", [data, f"{tag}_added"], [out])]
    del graph.node[:]
    graph.node.extend(new_nodes)


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


# -- the export ---------------------------------------------------------------------------------


def export_program(
    flat: TorchExportFlat,
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    opset: int,
    static_shapes: bool,
    where: str,
) -> onnx.ModelProto:
    """``flat`` (already in the mode to export in) -> the ONNX model, inputs named ``names``
    then every parameter and buffer the graph reads, without data."""
    try:
        import onnxscript  # noqa: F401, PLC0415
    except ImportError as err:
        raise ExportError(
            "ORTMODULE_EXPORTER=torch_export needs onnxscript (pip install onnxscript); "
            "unset ORTMODULE_EXPORTER for the TorchScript exporter",
            module_path=where,
        ) from err
    try:
        program = torch.export.export(
            flat,
            tuple(tensors),
            dynamic_shapes=_dynamic_shapes(tensors, static_shapes),
            strict=False,
        )
    except Exception as err:
        if flat.output_error is not None:
            raise
        hint = ""
        if _data_dependent(err):
            hint = (
                "\nThe forward branches on (or reads as a Python value) a tensor's data, which "
                "torch.export does not capture: compute it with tensor ops (torch.where, "
                "torch.cond), or use ORTMODULE_EXPORTER=torchscript, which guards the value the "
                "trace saw."
            )
        raise ExportError(
            f"torch.export could not capture {where}: {type(err).__name__}: "
            f"{_first_lines(str(err))}{hint}",
            module_path=where,
        ) from err
    functions = [f for f in flat.functions if f not in _INLINE_SAFE_FUNCTIONS]
    if functions:
        raise ExportError(
            f"{where} applies the custom autograd.Function {', '.join(functions)}: torch.export "
            "keeps its forward and drops its backward, so the engine would differentiate the "
            "forward instead (wrong gradients). ORTMODULE_EXPORTER=torch_export does not run "
            "custom Functions yet: use ORTMODULE_EXPORTER=torchscript (PythonOp runs the "
            "backward).",
            module_path=where,
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onnx_program = torch.onnx.export(
                program,
                (),
                dynamo=True,
                opset_version=opset,
                optimize=False,
                verbose=False,
                custom_translation_table=training_translations(opset),
            )
    except Exception as err:
        raise ExportError(
            f"the ONNX translation of {where}'s torch.export graph failed: "
            f"{type(err).__name__}: {_first_lines(str(err))}",
            module_path=where,
        ) from err
    assert onnx_program is not None
    if not static_shapes:
        flat.shape_guards = size_guards(program, names, tensors)
    model = onnx_program.model_proto
    return _as_training_graph(model, program, names, where, canonical_state_names(flat))


def size_guards(
    program: torch.export.ExportedProgram, names: Sequence[str], tensors: Sequence[torch.Tensor]
) -> list[ShapeGuard]:
    """What torch.export assumed of the input sizes, checked before each run.

    ``Dim.AUTO`` asks for every dim to stay symbolic, but torch.export fixes a dim whose size
    the forward uses as a Python int (``range(x.shape[3])``: a loop unrolled that many times,
    and size 0/1 dims), bounds one a branch compared (``if x.shape[0] > 3``, a range
    constraint) and makes equal the dims it found equal (one symbol). The ONNX graph holds
    these assumptions without checking them: fed other sizes, it runs and returns the traced
    loop's outputs, silently wrong. This guard's value is, in order, every fixed dim's size,
    then 1 for each bound and equality that holds (0 where not): on another value the runtime
    exports a graph for the new sizes, as for the TorchScript frontend's size guards. A dim
    given by an expression of other dims (``2 * s0``) is checked as a fixed size.
    """
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user = [nodes[n] for n in program.graph_signature.user_inputs if n in nodes]
    if len(user) != len(names):
        return []
    int64 = onnx.TensorProto.INT64
    steps: list[_Step] = []
    parts: list[str] = []
    traced: list[int] = []
    said: list[str] = []
    shapes: dict[str, tuple[Dim, ...]] = {}
    first: dict[Any, str] = {}

    def constant(value: int) -> str:
        out = f"size_guard/const{len(steps)}"
        steps.append(_Step("Constant", (), out, (("value", np.array(value, np.int64)),)))
        return out

    def size(name: str, axis: int) -> str:
        out = f"size_guard/{name}/{axis}"
        if not any(s.output == out for s in steps):
            shape = f"size_guard/{name}/shape"
            if name not in shapes:
                shapes[name] = tuple(
                    Dim(name, a) for a in range(len(tensors[names.index(name)].shape))
                )
                steps.append(_Step("Shape", (name,), shape, ()))
            steps.append(_Step("Gather", (shape, constant(axis)), out, (("axis", 0),)))
        return out

    def holds(op: str, a: str, b: str, text: str) -> None:
        out = f"size_guard/check{len(steps)}"
        steps.append(_Step(op, (a, b), out, ()))
        steps.append(_Step("Cast", (out,), out + "/int", (("to", int64),)))
        parts.append(out + "/int")
        traced.append(1)
        said.append(text)

    for name, node, tensor in zip(names, user, tensors, strict=True):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for axis, dim in enumerate(value.shape):
            where = f"{name}.shape[{axis}]"
            expr = dim.node.expr if isinstance(dim, torch.SymInt) else None
            if expr is None or not getattr(expr, "is_Symbol", False):
                # fixed by torch.export, or an expression of other dims: this size only
                parts.append(size(name, axis))
                traced.append(int(tensor.shape[axis]))
                said.append(f"{where} == {int(tensor.shape[axis])}")
                continue
            if expr in first:
                holds("Equal", size(name, axis), first[expr], f"{where} == {first[expr]}")
                continue
            first[expr] = size(name, axis)
            bounds = program.range_constraints.get(expr)
            lower = int(bounds.lower) if bounds is not None else 0
            upper = bounds.upper if bounds is not None else None
            # 0 and 1 are what Dim.AUTO leaves out by itself (both fixed when traced): a
            # bound above 2 is one the forward's code set
            if lower > 2:
                holds("Greater", first[expr], constant(lower - 1), f"{where} >= {lower}")
            # (``int_oo``, torch's unbounded size, says it is finite: only an Integer is)
            if upper is not None and getattr(upper, "is_Integer", False):
                holds("Less", first[expr], constant(int(upper) + 1), f"{where} <= {int(upper)}")
    if not parts:
        return []
    steps.append(_Step("Concat", tuple(parts), "size_guard/value", (("axis", 0),)))
    guard = Guard(
        "int",
        torch.tensor(traced, dtype=torch.int64),
        "torch.export's assumptions on the input sizes: " + ", ".join(said),
    )
    return [ShapeGuard(guard, tuple(steps), "size_guard/value", tuple(shapes.items()))]


def _data_dependent(err: BaseException) -> bool:
    """Whether ``err`` is torch.export refusing a branch on (or a read of) a tensor's value."""
    text = f"{type(err).__name__}: {err}"
    return "DataDependent" in text or "data-dependent" in text or "data dependent" in text


def _first_lines(text: str, n: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:n])


def canonical_state_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name of a parameter or buffer -> the name ``named_parameters()`` /
    ``named_buffers()`` give it (the first). A tied weight (an embedding shared with the LM
    head) has two names, and torch.export may lift it under either; the runtime feeds and
    trains parameters by the first."""
    canonical: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def _as_training_graph(
    model: onnx.ModelProto,
    program: torch.export.ExportedProgram,
    names: Sequence[str],
    where: str,
    canonical: dict[str, str],
) -> onnx.ModelProto:
    """Inline local functions, make initializers (parameters, buffers) graph inputs without
    data, rename user inputs to ``names``. Lifted constants stay initializers."""
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
        del model.functions[:]
    _cast_like_as_cast(model)
    _matmul_vectors_as_matrices(model)
    _scatter_add_onto_zeros(model)
    _outputs_for_gradients(model)
    _layer_norm_bias(model)
    _layer_norm_centered(model)
    _max_pool_values_gathered(model)
    graph = model.graph
    sig = program.graph_signature
    state = set(sig.inputs_to_parameters.values()) | set(sig.inputs_to_buffers.values())
    user = [vi for vi in graph.input]
    if len(user) != len(names):
        raise ExportError(
            f"the torch.export graph of {where} has {len(user)} inputs for {len(names)} tensors",
            module_path=where,
        )
    renames = {vi.name: name for vi, name in zip(user, names, strict=True)}
    kept_inits = []
    state_inputs = []
    for init in graph.initializer:
        if init.name in state:
            vi = onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            state_inputs.append(vi)
        else:
            kept_inits.append(init)
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    graph.input.extend(state_inputs)
    for vi in state_inputs:
        if canonical.get(vi.name, vi.name) != vi.name:
            renames[vi.name] = canonical[vi.name]
    for old, new in renames.items():
        if old != new:
            onnx_graph.rename_value(graph, old, new)
    # two names of one tied tensor, both lifted, are one input now
    first: dict[str, onnx.ValueInfoProto] = {}
    for vi in graph.input:
        first.setdefault(vi.name, vi)
    unique = list(first.values())
    if len(unique) != len(graph.input):
        del graph.input[:]
        graph.input.extend(unique)
    return model
