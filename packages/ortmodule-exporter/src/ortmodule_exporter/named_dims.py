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

from typing import Any

import onnx

from .aten.executor import ATEN_DOMAIN
from .aten.topk import TOPK_INDICES, parse_topk_overload
from .engine_binding import import_onnxruntime
from .onnx_graph import attribute
from .sparsity.token_rows import PUT_ROWS, TAKE_ROWS

__all__ = ["infer_symbolic_shapes"]


def infer_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with named (symbolic) dims on every tensor the engine's shape inference leaves
    anonymous; the engine's gather insertion needs them. Raises if inference fails.

    ONNX Runtime's ``SymbolicShapeInference.infer_shapes``, with the output shapes of our
    row-moving ATen nodes (:mod:`ortmodule_exporter.sparsity.token_rows`) added (it would guess
    them as the first input's rank), and without the file it writes into the working directory
    when inference is incomplete."""

    import_onnxruntime()  # the engine package, without its slow training self-check
    from onnxruntime.tools import symbolic_shape_infer as ssi

    inference = ssi.SymbolicShapeInference(2**31 - 1, True, True, 0)

    def rows_shape(take: bool) -> Any:
        def infer(node: onnx.NodeProto) -> None:
            data = inference._get_sympy_shape(node, 0)
            if take:  # (batch, seq, ...) -> (rows, ...)
                shape = [*inference._get_sympy_shape(node, 1)[:1], *data[2:]]
            else:  # (rows, ...) -> (batch, seq, ...), the grid being the inverse index's shape
                shape = [*inference._get_sympy_shape(node, 2), *data[1:]]
            elem = inference.known_vi_[node.input[0]].type.tensor_type.elem_type
            inference.known_vi_[node.output[0]].CopyFrom(
                onnx.helper.make_tensor_value_info(
                    node.output[0], elem, ssi.get_shape_from_sympy_shape(shape)
                )
            )

        return infer

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

    inference.aten_op_dispatcher_[TAKE_ROWS] = rows_shape(True)
    inference.aten_op_dispatcher_[TOPK_INDICES] = topk_shape
    inference.aten_op_dispatcher_[PUT_ROWS] = rows_shape(False)

    # An ATen operator it has no rule for gets its first input's type (cpmant's mask,
    # ``bool_mask & int32_mask``, became bool where PyTorch makes int32, and the engine then
    # refused the Equal reading it); the ATen pass declared the type the export traced: keep it.
    declared = {vi.name: vi for vi in model.graph.value_info if vi.type.tensor_type.elem_type}
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
