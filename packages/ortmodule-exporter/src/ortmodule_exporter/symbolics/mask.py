"""Symbolics for the integer and boolean arithmetic that builds attention masks and positions.

Hugging Face's mask code (``transformers.masking_utils``) and position code run ``cumsum`` on
bool and int tensors (``(position_diff != 1).cumsum(-1)`` to find packed sequences,
``attention_mask.cumsum(-1)`` for positions). PyTorch promotes a bool or small-int ``cumsum``
to int64, but its ONNX export emits ``CumSum`` on the input type as is, and ONNX ``CumSum``
takes only int32/int64/float types: the graph is invalid for ``tensor(bool)``. These values
carry no gradient; the symbolic only makes the graph valid and its dtype equal eager's.

Masks are applied with ``torch.where(mask, scores_or_bias, finfo.min)``, where the differentiable
branch often broadcasts against the mask (T5's relative position bias ``(1, heads, q, k)`` under
a ``(batch, 1, q, k)`` padding mask). The engine's gradient of ONNX ``Where`` does not sum the
gradient back over broadcast dims: the gradient keeps the output's shape and the backward graph
fails further up (or hands PyTorch a gradient of the wrong shape). So a branch that needs a
gradient and broadcasts is expanded to the output's shape first: ``Expand``'s gradient reduces.
"""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset9
from .helpers import _ints
from .registry import register_symbolic

Value = Any  # torch._C.Value

# input types that eager PyTorch accumulates in int64 when no dtype is given
_PROMOTED_TO_INT64 = ("Bool", "Byte", "Char", "Short", "Int")
_ONNX_INT64 = 7
_ONNX_BOOL = 9
_INT64_MAX = 2**63 - 1
_FLOAT_TYPES = ("Float", "Half", "Double", "BFloat16")
# c10::ScalarType code of an aten ``dtype`` argument -> ONNX TensorProto element type
_ONNX_TYPE_OF_CODE = {0: 2, 1: 3, 2: 5, 3: 6, 4: 7, 5: 10, 6: 1, 7: 11, 11: 9, 15: 16}


def cumsum(g: Any, x: Value, dim: Value, dtype: Value = None) -> Value:
    """``torch.cumsum(x, dim, dtype=dtype)`` with eager's result type for every input type."""
    axis = g.op("Constant", value_t=torch.tensor(sh._get_const(dim, "i", "dim"), dtype=torch.int64))
    code = None if dtype is None or sh._is_none(dtype) else sh._get_const(dtype, "i", "dtype")
    if code is not None:
        if code not in _ONNX_TYPE_OF_CODE:
            raise ValueError(f"aten::cumsum: dtype code {code} has no ONNX CumSum equivalent")
        target: int | None = _ONNX_TYPE_OF_CODE[code]
    else:
        name = x.type().scalarType() if x.type().kind() == "TensorType" else None
        target = _ONNX_INT64 if name in _PROMOTED_TO_INT64 else None
    if target is not None:
        x = g.op("Cast", x, to_i=target)
    return g.op("CumSum", x, axis)


def _needs_expanding(v: Value, out_sizes: list[int] | None) -> bool:
    """A branch that takes a gradient and may be smaller than the output."""
    if v is None or sh._is_none(v) or v.type().kind() != "TensorType":
        return False
    if not v.requiresGrad() or v.type().scalarType() not in _FLOAT_TYPES:
        return False
    sizes = v.type().sizes()
    # equal traced shapes without size-1 dims cannot broadcast at run time either
    return not (sizes is not None and sizes == out_sizes and 1 not in sizes)


def where(
    g: Any, condition: Value, x: Value = None, y: Value = None, _outputs: Any = None
) -> Value:
    """``torch.where`` whose differentiable branches are expanded to the output's shape."""
    if x is None or sh._is_none(x):
        return symbolic_opset9.where(g, condition, x, y, _outputs)
    if not sh._is_bool(condition):
        condition = g.op("Cast", condition, to_i=_ONNX_BOOL)
    out = g.op("Where", condition, x, y)
    out_sizes = _traced_sizes(condition, x, y)
    expand_x, expand_y = _needs_expanding(x, out_sizes), _needs_expanding(y, out_sizes)
    if not (expand_x or expand_y):
        return out
    shape = g.op("Shape", out)  # Shape has no gradient: this Where is never differentiated
    if expand_x:
        x = g.op("Expand", x, shape)
    if expand_y:
        y = g.op("Expand", y, shape)
    return g.op("Where", condition, x, y)


def _traced_sizes(*values: Value) -> list[int] | None:
    """The broadcast shape of the traced example, or None when a shape is unknown."""
    shapes = []
    for v in values:
        if v.type().kind() != "TensorType" or v.type().sizes() is None:
            return None
        shapes.append(v.type().sizes())
    try:
        return list(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


def diff(
    g: Any, x: Value, n: Value, dim: Value, prepend: Value = None, append: Value = None
) -> Value:
    """``torch.diff(x, n, dim, prepend, append)`` as ONNX ``Slice`` and ``Sub`` (``Xor`` on bool).

    Hugging Face's mask code runs it on the position ids (``find_packed_sequence_indices``).
    PyTorch has no ONNX symbolic for it, so it was exported as an ATen node whose output shape
    symbolic inference cannot know, and the whole graph was then built without named dims: the
    engine's gradient builder wrote a ``Shape``, ``BroadcastGradientArgs`` and a copying
    ``ReduceSum`` for every ``Add`` and ``Mul`` (see ``engine.model_with_named_dims``).
    """
    count = sh._get_const(n, "i", "n")
    axis = sh._get_const(dim, "i", "dim")
    parts = [v for v in (prepend, x, append) if v is not None and not sh._is_none(v)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=axis)
    is_bool = sh._is_bool(x)
    axes, zero, one, last, end = (_ints(g, [v]) for v in (axis, 0, 1, -1, _INT64_MAX))
    for _ in range(count):
        later = g.op("Slice", x, one, end, axes)
        earlier = g.op("Slice", x, zero, last, axes)
        x = g.op("Xor" if is_bool else "Sub", later, earlier)
    return x


def register_mask_symbolics() -> None:
    """Register the symbolics above (called on import of ``ortmodule_exporter``)."""
    register_symbolic("aten::cumsum", cumsum, 14)
    register_symbolic("aten::diff", diff, 14)
    register_symbolic("aten::where", where, 14)
