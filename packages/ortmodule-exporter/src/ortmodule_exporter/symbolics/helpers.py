"""Graph helpers and type tables the symbolic families share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh

Value = Any  # torch._C.Value; the exporter's graph values are untyped in Python

_INT64_MAX = 2**63 - 1

# TorchScript scalar type names -> ONNX TensorProto element types
_ONNX_TYPE = {
    "Float": 1,
    "Byte": 2,
    "Char": 3,
    "Short": 5,
    "Int": 6,
    "Long": 7,
    "Bool": 9,
    "Half": 10,
    "Double": 11,
    "BFloat16": 16,
}
_TORCH_TYPE = {
    "Float": torch.float32,
    "Half": torch.float16,
    "Double": torch.float64,
    "BFloat16": torch.bfloat16,
    "Long": torch.int64,
    "Int": torch.int32,
    "Bool": torch.bool,
}
# c10::ScalarType codes, as aten ops receive a ``dtype`` argument
_SCALAR_TYPE_CODE = {5: "Half", 6: "Float", 7: "Double", 15: "BFloat16"}
_FLOAT_TYPES = ("Float", "Half", "Double", "BFloat16")


# -- small graph helpers -----------------------------------------------------------------------


def _scalar_type(v: Value) -> str | None:
    try:
        return v.type().scalarType()  # type: ignore[no-any-return]
    except RuntimeError:
        return None


def _float_type(v: Value) -> str:
    name = _scalar_type(v)
    return name if name in _FLOAT_TYPES else "Float"


def _rank(v: Value, op: str) -> int:
    rank = sh._get_tensor_rank(v)
    if rank is None:
        raise ValueError(f"{op}: the rank of the input is not known at export time")
    return int(rank)


def _const(g: Any, value: Any, dtype: torch.dtype = torch.float32) -> Value:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _ints(g: Any, values: Sequence[int]) -> Value:
    return _const(g, list(values), torch.int64)


def _shape(g: Any, x: Value) -> Value:
    return g.op("Shape", x)


def _dims(g: Any, x: Value, start: int, end: int | None = None) -> Value:
    """Shape(x)[start:end] as a 1-D int64 tensor."""
    stop = _INT64_MAX if end is None else end
    return g.op("Slice", _shape(g, x), _ints(g, [start]), _ints(g, [stop]))


def _dim(g: Any, x: Value, axis: int) -> Value:
    """Shape(x)[axis] as a 1-element 1-D int64 tensor."""
    return g.op("Gather", _shape(g, x), _ints(g, [axis]))


def _dim_scalar(g: Any, x: Value, axis: int) -> Value:
    """Shape(x)[axis] as a 0-d int64 tensor."""
    return g.op("Squeeze", _dim(g, x, axis), _ints(g, [0]))


def _concat(g: Any, *parts: Value) -> Value:
    return parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis_i=0)


def _unsqueeze(g: Any, x: Value, axes: Sequence[int]) -> Value:
    return g.op("Unsqueeze", x, _ints(g, axes))


def _squeeze(g: Any, x: Value, axes: Sequence[int]) -> Value:
    return g.op("Squeeze", x, _ints(g, axes))


def _reduce(g: Any, op: str, x: Value, axes: Sequence[int] | None, keepdims: bool) -> Value:
    """Reduce over ``axes`` (all when None); ReduceSum takes axes as an input from opset 13,
    the others from opset 18."""
    if axes is None:
        return g.op(op, x, keepdims_i=int(keepdims))
    if op == "ReduceSum" or g.opset >= 18:
        return g.op(op, x, _ints(g, axes), keepdims_i=int(keepdims))
    return g.op(op, x, axes_i=list(axes), keepdims_i=int(keepdims))


def _cast(g: Any, x: Value, type_name: str) -> Value:
    return g.op("Cast", x, to_i=_ONNX_TYPE[type_name])


def _stop_gradient(g: Any, v: Value) -> Value:
    """``v``'s exact value with no gradient path back to ``v``.

    ONNX has no stop-gradient operator. The engine never differentiates BatchNormalization
    through its running-mean input (a stop-gradient edge), and a training-mode node with
    momentum 1 hands that input back unchanged as its new running mean (``mean * 1 + batch_mean
    * 0`` with a zero batch), so the value crosses without a gradient edge. Cost: one pass over
    ``v``.
    """
    dtype = _TORCH_TYPE[_float_type(v)]
    flat = g.op("Reshape", v, _ints(g, [-1]))
    n = _shape(g, flat)

    def filled(shape: Value, value: float) -> Value:
        return g.op("ConstantOfShape", shape, value_t=torch.tensor([value], dtype=dtype))

    # two zero rows: a one-row batch has no variance, which some kernels reject
    zeros_x = filled(_concat(g, _ints(g, [2]), n), 0.0)
    ones, zeros = filled(n, 1.0), filled(n, 0.0)
    _, running_mean, _ = g.op(
        "BatchNormalization",
        zeros_x,
        ones,
        zeros,
        flat,
        ones,
        epsilon_f=1e-5,
        momentum_f=1.0,
        training_mode_i=1,
        outputs=3,
    )
    return g.op("Reshape", running_mean, _shape(g, v))


def _const_ints(v: Value) -> list[int] | None:
    """A constant int or int list argument as a list, None when absent or not constant."""
    if v is None or sh._is_none(v):
        return None
    if not sh._is_constant(v):
        return None
    value = sh._node_get(v.node(), "value")
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(i) for i in value] if isinstance(value, (list, tuple)) else [int(value)]


def _per_dim(values: Sequence[int], n: int, default: Sequence[int] | None = None) -> list[int]:
    """A per-spatial-dim list from aten's form: one value for every dim, or empty = default."""
    values = list(values) if values else list(default or [])
    return values * n if len(values) == 1 else values


def _device_type(v: Value) -> str | None:
    """The traced tensor's device type ("cpu", "cuda"), None when the exporter does not say."""
    try:
        device = v.type().device()
    except (RuntimeError, AttributeError):
        return None
    return None if device is None else str(device.type)
