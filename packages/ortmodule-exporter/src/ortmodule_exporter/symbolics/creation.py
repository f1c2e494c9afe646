"""Creation symbolics: ``linspace``, ``logspace``, ``tril_indices``, ``triu_indices``.

torch exports none of the last three for sizes that come from traced shapes
(``torch.logspace(0, 1, t.shape[-1])``): the operator went to PyTorch as an ATen node whose
output type the engine could not infer, and the build failed. torch's ``linspace`` ignores its
``dtype`` (float64 came out float32) and divides by zero for one step. Here they are ONNX
arithmetic on ``Range``.

>>> from ortmodule_exporter.symbolics.registry import registered_symbolics
>>> "aten::tril_indices" in registered_symbolics()  # after ortmodule_exporter is imported
True
"""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import type_utils
from .helpers import Value, _const, _unsqueeze

_INT64 = 7


def _scalar_int(g: Any, v: Value) -> Value:
    return g.op("Cast", v, to_i=_INT64)


def _range(g: Any, size: Value) -> Value:
    return g.op("Range", _const(g, 0, torch.int64), _scalar_int(g, size), _const(g, 1, torch.int64))


def _dtype(dtype: Value, op: str) -> torch.dtype:
    code = sh._maybe_get_const(dtype, "i")
    if code is None or sh._is_none(dtype):
        return torch.get_default_dtype()
    if not isinstance(code, int):
        raise ValueError(f"{op}: the dtype must be a constant")
    return type_utils.JitScalarType(code).dtype()


def _onnx_type(dtype: torch.dtype) -> Any:
    return type_utils.JitScalarType.from_dtype(dtype).onnx_type()


def _evenly_spaced(g: Any, start: Value, end: Value, steps: Value, work: torch.dtype) -> Value:
    """``start + i * (end - start) / (steps - 1)`` for i in [0, steps), in ``work``; one step
    gives ``start``. (A unit span makes the step ``1 / (steps - 1)``, the Div the engine's
    DivMulFusion crashes on: passes/engine_graph_fixes.py rewrites it.)"""
    to = _onnx_type(work)
    start_f = g.op("Cast", start, to_i=to)
    end_f = g.op("Cast", end, to_i=to)
    index = g.op("Cast", _range(g, steps), to_i=to)
    last = g.op("Cast", g.op("Sub", _scalar_int(g, steps), _const(g, 1, torch.int64)), to_i=to)
    last = g.op("Max", last, _const(g, 1.0, work))
    step = g.op("Div", g.op("Sub", end_f, start_f), last)
    return g.op("Add", g.op("Mul", index, step), start_f)


def linspace(
    g: Any,
    start: Value,
    end: Value,
    steps: Value,
    dtype: Value,
    layout: Value = None,
    device: Value = None,
    pin_memory: Value = None,
) -> Value:
    out = _dtype(dtype, "aten::linspace")
    work = torch.float64 if out == torch.float64 else torch.float32
    values = _evenly_spaced(g, start, end, steps, work)
    return values if out == work else g.op("Cast", values, to_i=_onnx_type(out))


def logspace(
    g: Any,
    start: Value,
    end: Value,
    steps: Value,
    base: Value,
    dtype: Value,
    layout: Value = None,
    device: Value = None,
    pin_memory: Value = None,
) -> Value:
    # base ** (start + i * (end - start) / (steps - 1)), computed in float32 (float64 when the
    # result is double), as eager does; a result of one step is base ** start
    out = _dtype(dtype, "aten::logspace")
    work = torch.float64 if out == torch.float64 else torch.float32
    exponent = _evenly_spaced(g, start, end, steps, work)
    power = g.op("Pow", g.op("Cast", base, to_i=_onnx_type(work)), exponent)
    return power if out == work else g.op("Cast", power, to_i=_onnx_type(out))


def _triangle_indices(lower: bool) -> Any:
    op = "aten::tril_indices" if lower else "aten::triu_indices"

    def symbolic(
        g: Any,
        row: Value,
        col: Value,
        offset: Value,
        dtype: Value = None,
        layout: Value = None,
        device: Value = None,
        pin_memory: Value = None,
    ) -> Value:
        # (2, count) row-major coordinates (i, j) with j - i <= offset (lower) or >= offset
        # (upper): NonZero of that mask lists them in the same row-major order eager does
        shift = sh._maybe_get_const(offset, "i")
        if not isinstance(shift, int):
            raise ValueError(f"{op}: the offset must be a constant")
        rows = _unsqueeze(g, _range(g, row), [1])
        cols = _unsqueeze(g, _range(g, col), [0])
        diagonal = g.op("Sub", cols, rows)
        bound = _const(g, shift, torch.int64)
        mask = g.op("LessOrEqual" if lower else "GreaterOrEqual", diagonal, bound)
        indices = g.op("NonZero", mask)
        out = torch.int64 if dtype is None or sh._is_none(dtype) else _dtype(dtype, op)
        if out != torch.int64:
            indices = g.op("Cast", indices, to_i=_onnx_type(out))
        return indices

    return symbolic


tril_indices = _triangle_indices(lower=True)
triu_indices = _triangle_indices(lower=False)
