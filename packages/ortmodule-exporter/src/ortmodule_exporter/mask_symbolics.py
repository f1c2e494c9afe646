"""Symbolics for the integer and boolean arithmetic that builds attention masks and positions.

Hugging Face's mask code (``transformers.masking_utils``) and position code run ``cumsum`` on
bool and int tensors (``(position_diff != 1).cumsum(-1)`` to find packed sequences,
``attention_mask.cumsum(-1)`` for positions). PyTorch promotes a bool or small-int ``cumsum``
to int64, but its ONNX export emits ``CumSum`` on the input type as is, and ONNX ``CumSum``
takes only int32/int64/float types: the graph is invalid for ``tensor(bool)``. These values
carry no gradient; the symbolic only makes the graph valid and its dtype equal eager's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.onnx import symbolic_helper as sh

from .symbolic_registry import register_symbolic

Value = Any  # torch._C.Value

# input types that eager PyTorch accumulates in int64 when no dtype is given
_PROMOTED_TO_INT64 = ("Bool", "Byte", "Char", "Short", "Int")
_ONNX_INT64 = 7
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


def register_mask_symbolics() -> None:
    """Register the symbolics above (called on import of ``ortmodule_exporter``)."""
    register_symbolic("aten::cumsum", cumsum, 14)
