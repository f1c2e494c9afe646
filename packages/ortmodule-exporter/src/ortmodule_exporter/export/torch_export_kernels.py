"""Narrow integer operands of the ``torch_export`` frontend's ONNX graph, for the CPU engine.

torch's decompositions compute in the narrowest integer type that holds the values: ``eye``
(``linalg.matrix_power``'s power 0, ``torch.eye`` itself) is ``iota(n, dtype=uint8)`` twice and
``eq`` of them, which torch_lib writes as ``Equal`` on uint8. The CPU engine (1.19.2) has its
integer kernels for int32 and int64 only (no Equal, Less, Add, ... on uint8, int8, int16, uint16,
uint32), and refuses the session ("Could not find an implementation for Equal(13)"). The
TorchScript frontend never sees them (its symbolics start from ``aten::eye``).

:func:`widen_narrow_integer_operands` casts each narrow integer operand of a node the engine
has no CPU kernel for (asked of the engine: :func:`~ortmodule_exporter.aten.engine_kernels.
cpu_kernel_exists`) to int64, when the engine has the int64 kernel and the operator gives the
same result there: comparisons, ``Min``/``Max``/``Where`` exactly; ``Add``/``Sub``/``Mul``/``Neg``/
``Abs`` cast back to the narrow type (two's complement arithmetic modulo the narrow width is the
same, and Cast to a narrower integer keeps the low bits). Other operators stay as they are and
the engine's error names them. Integer values carry no gradient, so training is untouched.

>>> from ortmodule_exporter.export.torch_export_kernels import widen_narrow_integer_operands
"""

from __future__ import annotations

import onnx
import onnx.shape_inference

from .. import onnx_graph
from ..aten.engine_kernels import cpu_kernel_exists

__all__ = ["widen_narrow_integer_operands"]

T = onnx.TensorProto
#: integer types the CPU engine's arithmetic and comparison kernels lack (1.19.2)
_NARROW = frozenset({T.UINT8, T.INT8, T.INT16, T.UINT16, T.UINT32})
#: operators whose result is the same computed on int64 operands (bool out)
_COMPARISONS = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"})
#: operators whose int64 result cast back to the narrow type is the narrow result
_SAME_LOW_BITS = frozenset({"Min", "Max", "Where", "Add", "Sub", "Mul", "Neg", "Abs"})


def _types(model: onnx.ModelProto) -> dict[str, int]:
    types = onnx_graph.declared_types(model)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)


def widen_narrow_integer_operands(model: onnx.ModelProto) -> None:
    """The rewrite of the module docstring, in place."""
    graph = model.graph
    ops = _COMPARISONS | _SAME_LOW_BITS
    candidates = [n for n in graph.node if n.op_type in ops and n.domain in ("", "ai.onnx")]
    if not candidates:
        return
    types = _types(model)
    if any(i and i not in types for n in candidates for i in n.input):
        types.update(_types(onnx.shape_inference.infer_shapes(model)))
    opset = _opset(model)
    h = onnx.helper
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        kinds = [types.get(i, 0) for i in node.input] if node in candidates else []
        narrow = [k for k in kinds if k in _NARROW]
        if not narrow or not all(kinds) or len(node.output) != 1:
            new_nodes.append(node)
            continue
        comparison = node.op_type in _COMPARISONS
        out_type = T.BOOL if comparison else narrow[0]
        widened = [T.INT64 if k in _NARROW else k for k in kinds]
        out_wide = T.BOOL if comparison else T.INT64
        if cpu_kernel_exists(node.op_type, kinds, (out_type,), opset=opset) or not (
            cpu_kernel_exists(node.op_type, widened, (out_wide,), opset=opset)
        ):
            new_nodes.append(node)
            continue
        tag = f"{node.name or node.op_type}_{index}"
        for slot, kind in enumerate(kinds):
            if kind in _NARROW:
                cast = f"{tag}_as_int64_{slot}"
                new_nodes.append(h.make_node("Cast", [node.input[slot]], [cast], to=T.INT64))
                node.input[slot] = cast
        new_nodes.append(node)
        if not comparison:
            out = node.output[0]
            node.output[0] = f"{tag}_int64"
            new_nodes.append(h.make_node("Cast", [node.output[0]], [out], to=out_type))
    del graph.node[:]
    graph.node.extend(new_nodes)
