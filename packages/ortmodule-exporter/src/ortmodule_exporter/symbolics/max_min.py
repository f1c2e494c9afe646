"""``max``/``min`` and ``amax``/``amin`` symbolics."""

from __future__ import annotations

from typing import Any

import torch

from ..aten import executor as aten_executor
from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _FLOAT_TYPES,
    _TORCH_TYPE,
    Value,
    _cast,
    _const,
    _float_type,
    _ints,
    _rank,
    _reduce,
    _scalar_type,
    _squeeze,
)

# -- max / min -------------------------------------------------------------------------------


def _tie_split_extreme(
    g: Any, x: Value, axes: list[int] | None, keepdim: bool, largest: bool
) -> Value:
    """max/min over ``axes`` whose gradient is shared evenly by the tied elements (eager's
    rule for ``max()`` and ``amax``). The extreme value only selects: it reaches the result
    through Equal, which the engine never differentiates."""
    extreme = _reduce(g, "ReduceMax" if largest else "ReduceMin", x, axes, keepdims=True)
    hit = g.op("Equal", x, extreme)
    like = _float_type(x)
    picked = g.op("Where", hit, x, _const(g, 0.0, _TORCH_TYPE[like]))
    count = _reduce(g, "ReduceSum", _cast(g, hit, like), axes, keepdims=keepdim)
    total = _reduce(g, "ReduceSum", picked, axes, keepdims=keepdim)
    return g.op("Div", total, count)


def _elementwise_extreme(g: Any, x: Value, other: Value, largest: bool) -> Value:
    """``maximum``/``minimum`` (and binary ``max``/``min``) with eager's gradient.

    The engine's gradient of ``Max``/``Min`` divides ``dY`` by how many inputs equal the
    result and multiplies by each input's mask: where an input is NaN no input equals the
    NaN result, so both got ``0 * (dY / 0)``. Eager gives the whole gradient to the selected
    input, half to each of two tied ones, and (no order between them) the whole gradient to
    both where one is NaN. Nested ``Where`` nodes give exactly that, since the gradient of
    ``Where`` selects: the tie branch is ``(x + other) / 2`` and the unordered branch
    ``x + other`` (NaN, like eager's result)."""
    if _scalar_type(other) != _scalar_type(x) and _scalar_type(x) in _FLOAT_TYPES:
        other = _cast(g, other, _float_type(x))
    sizes = _sizes(x)
    if _scalar_type(x) not in _FLOAT_TYPES or (not sizes and not _sizes(other)):
        # integers; and two 0-d operands: torch.masked.normalize's maximum(norm,
        # new_full([], eps)) of a 0-d input got the output shape (1,) through the Where path
        # below (OpInfo)
        return g.op("Max" if largest else "Min", x, other)
    if sizes is None or None in sizes or sizes != _sizes(other):
        # the engine's gradients of broadcasting Add/Where need the shapes of gradients that its
        # Where gradient leaves untyped ("GetShape(input_grad) ... was false"): both operands
        # take the result's shape first, and Expand's gradient sums the broadcast axes
        shape = g.op("Shape", g.op("Add", x, other))
        x, other = g.op("Expand", x, shape), g.op("Expand", other, shape)
    wins, loses = ("Greater", "Less") if largest else ("Less", "Greater")
    both = g.op("Add", x, other)
    half = _const(g, 0.5, _TORCH_TYPE[_float_type(x)])
    tied = g.op("Where", g.op("Equal", x, other), g.op("Mul", both, half), both)
    picked = g.op("Where", g.op(wins, x, other), x, tied)
    return g.op("Where", g.op(loses, x, other), other, picked)


def _sizes(v: Value) -> list[int | None] | None:
    try:
        return v.type().varyingSizes()  # type: ignore[no-any-return]
    except RuntimeError:
        return None


def _elementwise(largest: bool) -> Any:
    def symbolic(g: Any, x: Value, other: Value) -> Value:
        return _elementwise_extreme(g, x, other, largest)

    return symbolic


def _reduce_axes(g: Any, op: str, x: Value, dims: list[int] | None) -> list[int] | None:
    if not dims:
        return None
    rank = _rank(x, op)
    return [d % rank if rank else 0 for d in dims]


def _max_min(largest: bool) -> Any:
    name = "aten::max" if largest else "aten::min"

    def symbolic(g: Any, x: Value, dim_or_other: Value = None, keepdim: Value = None) -> Any:
        if dim_or_other is None and keepdim is None:
            return _tie_split_extreme(g, x, None, False, largest)
        if keepdim is None:  # binary max(x, other)
            return _elementwise_extreme(g, x, dim_or_other, largest)
        # max(x, dim, keepdim) -> (values, indices): TopK has a gradient and, like eager,
        # returns the first of tied elements.
        dim = sh._get_const(dim_or_other, "i", "dim")
        keep = bool(sh._get_const(keepdim, "i", "keepdim"))
        if _rank(x, name) == 0:
            return x, _const(g, 0, torch.int64)
        if _scalar_type(x) in ("Half", "BFloat16") and _on_cpu(x) and aten_executor.installed():
            # the CPU engine's TopK has no bfloat16 kernel and runs float16 through float32
            # casts (the values came back float32): PyTorch's own max/min runs instead
            return _aten_max_min(g, x, dim_or_other, keepdim, largest, _rank(x, name) - (not keep))
        values, indices = g.op(
            "TopK", x, _ints(g, [1]), axis_i=dim, largest_i=int(largest), sorted_i=1, outputs=2
        )
        if not keep:
            values, indices = _squeeze(g, values, [dim]), _squeeze(g, indices, [dim])
        return values, indices

    return symbolic


def _on_cpu(v: Value) -> bool:
    jit_type: Any = v.type()
    device = jit_type.device() if hasattr(jit_type, "device") else None
    return device is None or device.type == "cpu"


def _aten_max_min(
    g: Any, x: Value, dim: Value, keepdim: Value, largest: bool, out_rank: int
) -> tuple[Value, Value]:
    values, indices = g.op(
        f"{aten_executor.ATEN_DOMAIN}::ATen",
        x,
        dim,
        keepdim,
        operator_s="max" if largest else "min",
        overload_name_s="dim",
        outputs=2,
    )
    values.setType(x.type().with_sizes([None] * out_rank))
    indices.setType(x.type().with_dtype(torch.int64).with_sizes([None] * out_rank))
    return values, indices


def _amax_amin(largest: bool) -> Any:
    name = "aten::amax" if largest else "aten::amin"

    @sh.parse_args("v", "is", "i")
    def symbolic(g: Any, x: Value, dim: list[int], keepdim: int) -> Value:
        return _tie_split_extreme(g, x, _reduce_axes(g, name, x, dim), bool(keepdim), largest)

    return symbolic
