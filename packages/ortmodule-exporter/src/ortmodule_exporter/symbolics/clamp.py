"""``clamp``/``clamp_min``/``clamp_max`` with one bound keep infinite inputs infinite.

PyTorch's exporter writes a one-sided clamp with a scalar bound as ``Clip`` with the other bound
left out, and the engine's ``Clip`` then bounds by the type's largest finite value: eager's
``clamp(inf, min=0)`` is ``inf``, the engine's was ``3.4e38`` (measured 2026-11-26 on the CPU
machine: an MLP's output finite where eager's is NaN). The absent bound is written as an
infinite constant instead. Tensor bounds and non-float tensors keep PyTorch's export.
"""

from __future__ import annotations

from typing import Any

from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset11
from .helpers import _FLOAT_TYPES, _TORCH_TYPE, Value, _cast, _const, _scalar_type


def _pytorch_clamp() -> Any:

    return symbolic_opset11.clamp


def _present(v: Value) -> bool:
    return v is not None and not sh._is_none(v)


def clamp(g: Any, self: Value, min: Value = None, max: Value = None) -> Value:
    """Export ``aten::clamp`` (and the one-sided variants through it)."""
    kind = _scalar_type(self)
    bounds = [b for b in (min, max) if _present(b)]
    if kind not in _FLOAT_TYPES or not bounds or any(sh._get_tensor_rank(b) != 0 for b in bounds):
        return _pytorch_clamp()(g, self, min, max)
    dtype = _TORCH_TYPE[kind]
    low = _cast(g, min, kind) if _present(min) else _const(g, -float("inf"), dtype)
    high = _cast(g, max, kind) if _present(max) else _const(g, float("inf"), dtype)
    return g.op("Clip", self, low, high)


def clamp_min(g: Any, self: Value, min: Value) -> Value:
    return clamp(g, self, min, None)


def clamp_max(g: Any, self: Value, max: Value) -> Value:
    return clamp(g, self, None, max)


__all__ = ["clamp", "clamp_max", "clamp_min"]
