"""Named (symbolic) dims on every tensor of an exported model: ONNX Runtime's symbolic shape
inference, taught the output shapes of our own ATen nodes.

The engine's builder drops no-op broadcast reductions only with named dims
(:func:`ortmodule_exporter.engine.build_graph`), its label-sparsity gather insertion fails on
unnamed dynamic dims (:mod:`ortmodule_exporter.sparsity.label_sparsity`), and the memory
optimizer's table counts bytes by them.

>>> from ortmodule_exporter.named_dims import infer_symbolic_shapes
>>> named = infer_symbolic_shapes(model)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import onnx

from .aten.executor import ATEN_DOMAIN
from .aten.output_shapes import ShapeRule, output_shape_rules
from .aten.topk import TOPK_INDICES, parse_topk_overload
from .engine_binding import import_onnxruntime
from .onnx_graph import attribute

__all__ = ["infer_symbolic_shapes", "teach_aten_shapes"]


def teach_aten_shapes(inference: Any, declared: Mapping[str, onnx.ValueInfoProto]) -> None:
    """Give ``inference`` (a ``SymbolicShapeInference``) the output shapes of the ATen nodes
    with a rule (:mod:`ortmodule_exporter.aten.output_shapes`); an output ``declared`` with an
    element type keeps that type.

    Without one, each such node's outputs get fresh dims, and where they meet the node's input
    again the inference merges them and restarts from the first node: a pass over the graph per
    LayerNorm routed to PyTorch (25 passes, 3.4 s, on GPT-2 small), with every input dim in
    those merges counted unsure. Its ``aten_op_dispatcher_`` (onnxruntime 1.19.2's table of the
    aten operators it knows, by name) takes one handler per rule.
    """
    dispatcher = getattr(inference, "aten_op_dispatcher_", None)
    if not isinstance(dispatcher, dict):  # pragma: no cover - another onnxruntime
        return
    for name, rule in output_shape_rules().items():
        dispatcher.setdefault(name, functools.partial(_infer_by_rule, inference, rule, declared))


def _infer_by_rule(
    inference: Any,
    rule: ShapeRule,
    declared: Mapping[str, onnx.ValueInfoProto],
    node: onnx.NodeProto,
) -> None:
    """One ATen node's outputs, typed as declared or else as its input 0 (what the inference
    guesses for a node it does not know) and shaped by ``rule``; a dim the rule leaves unknown
    gets a fresh name, and an output it cannot tell the rank of input 0 (also the inference's
    guess)."""
    known = inference.known_vi_
    shapes = [inference._get_shape(node, i) if name else None for i, name in enumerate(node.input)]
    found = list(rule(shapes, str(attribute(node, "overload_name", ""))))
    first_type = known[node.input[0]].type.tensor_type.elem_type
    for i, output in enumerate(node.output):
        if not output:
            continue
        shape = found[i] if i < len(found) else None
        if shape is None:
            if shapes[0] is None:
                continue
            shape = [None] * len(shapes[0])
        dims = [
            str(inference._new_symbolic_dim_from_output(node, i, axis)) if d is None else d
            for axis, d in enumerate(shape)
        ]
        given = declared.get(output)
        dtype = given.type.tensor_type.elem_type if given is not None else 0
        known[output].CopyFrom(
            onnx.helper.make_tensor_value_info(output, dtype or first_type, dims)
        )


def infer_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with named (symbolic) dims on every tensor the engine's shape inference leaves
    anonymous; the engine's gather insertion needs them. Raises if inference fails.

    ONNX Runtime's ``SymbolicShapeInference.infer_shapes``, taught the output shapes of our ATen
    nodes (:func:`teach_aten_shapes`, and top-k's indices, whose size may be a value), and
    without the file it writes into the working directory when inference is incomplete."""

    import_onnxruntime()  # the engine package, without its slow training self-check
    from onnxruntime.tools import symbolic_shape_infer as ssi

    inference = ssi.SymbolicShapeInference(2**31 - 1, True, True, 0)

    def topk_shape(node: onnx.NodeProto) -> None:
        # the input's shape with k along the picked dim
        shape = inference._get_sympy_shape(node, 0)
        k, dim, _, _ = parse_topk_overload(str(attribute(node, "overload_name", "")))
        axis = dim % len(shape)
        if k is None:
            k = inference._try_get_value(node, 1)
        shape[axis] = k if k is not None else inference._new_symbolic_dim_from_output(node, 0, axis)
        inference.known_vi_[node.output[0]].CopyFrom(
            onnx.helper.make_tensor_value_info(
                node.output[0], onnx.TensorProto.INT64, ssi.get_shape_from_sympy_shape(shape)
            )
        )

    # An ATen operator it has no rule for gets its first input's type (cpmant's mask,
    # ``bool_mask & int32_mask``, became bool where PyTorch makes int32, and the engine then
    # refused the Equal reading it); the ATen pass declared the type the export traced: keep it.
    declared = {vi.name: vi for vi in model.graph.value_info if vi.type.tensor_type.elem_type}
    inference.aten_op_dispatcher_[TOPK_INDICES] = topk_shape
    teach_aten_shapes(inference, declared)
    onnx_infer = inference._onnx_infer_single_node

    def infer_node(node: onnx.NodeProto) -> None:
        onnx_infer(node)
        if node.domain != ATEN_DOMAIN or attribute(node, "operator", "") in (
            inference.aten_op_dispatcher_
        ):
            return
        # only where the first input's type is not the declared one: elsewhere the rule it
        # falls back on (the first input's type and shape) is right, and other rules follow
        # the shape it gives (label sparsity needs it)
        first = inference.known_vi_.get(node.input[0]) if node.input else None
        first_type = first.type.tensor_type.elem_type if first is not None else 0
        for name in node.output:
            if name in declared and name in inference.known_vi_:
                if declared[name].type.tensor_type.elem_type != first_type:
                    inference.known_vi_[name].CopyFrom(declared[name])

    inference._onnx_infer_single_node = infer_node
    inference._preprocess(model)
    complete = False
    while inference.run_:
        complete = inference._infer_impl()
    inference._update_output_from_vi()
    if not complete:
        raise RuntimeError("symbolic shape inference left some shapes unknown")
    inferred: onnx.ModelProto = inference.out_mp_
    return inferred
