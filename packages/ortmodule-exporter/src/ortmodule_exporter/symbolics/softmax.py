"""``softmax`` and ``log_softmax`` symbolics."""

from __future__ import annotations

from typing import Any

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import _SCALAR_TYPE_CODE, Value, _cast, _const_ints, _device_type, _scalar_type

# -- softmax ---------------------------------------------------------------------------------


def _softmax_like(onnx_op: str) -> Any:
    @sh.parse_args("v", "i", "none")
    def symbolic(g: Any, x: Value, dim: int, dtype: Value = None) -> Value:
        # ATen casts to ``dtype`` before the softmax; the default export casts the result, so
        # a float16 input with dtype=float32 loses the precision the caller asked for. The
        # exception is float64 off CUDA: the CPU engine has no float64 SoftmaxGrad or
        # LogSoftmaxGrad kernel, so the softmax stays in the input's type and only the result
        # is cast (trainable, at the input's precision).
        code = _const_ints(dtype)
        if code is None:
            return g.op(onnx_op, x, axis_i=dim)
        name = _SCALAR_TYPE_CODE.get(code[0])
        if name is None:
            raise ValueError(f"aten::{onnx_op.lower()}: unsupported dtype code {code[0]}")
        if name == "Double" and _device_type(x) != "cuda" and _scalar_type(x) != "Double":
            return _cast(g, g.op(onnx_op, x, axis_i=dim), name)
        if _scalar_type(x) != name:
            x = _cast(g, x, name)
        return g.op(onnx_op, x, axis_i=dim)

    return symbolic


softmax = _softmax_like("Softmax")
log_softmax = _softmax_like("LogSoftmax")
