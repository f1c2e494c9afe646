"""Pooling symbolics: max, average and adaptive pooling in 1, 2 and 3 dims."""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _TORCH_TYPE,
    Value,
    _cast,
    _concat,
    _const,
    _const_ints,
    _dim_scalar,
    _dims,
    _float_type,
    _ints,
    _per_dim,
    _rank,
    _reduce,
    _squeeze,
    _unsqueeze,
)

# -- pooling ---------------------------------------------------------------------------------


def _max_pool(n: int, with_indices: bool) -> Any:
    @sh.parse_args("v", "is", "is", "is", "is", "i")
    def symbolic(
        g: Any,
        x: Value,
        kernel: list[int],
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        ceil_mode: int,
    ) -> Any:
        # The engine's CPU MaxPoolGrad sizes its output from the static shape of the node, so
        # with dynamic dims it writes out of bounds. MaxPool only picks the indices here; the
        # values are gathered from the flattened input, and Gather's gradient scatters back.
        kernel = _per_dim(kernel, n)
        _, flat_indices = g.op(
            "MaxPool",
            x,
            kernel_shape_i=kernel,
            strides_i=_per_dim(stride, n, kernel),
            pads_i=_per_dim(padding, n) * 2,
            dilations_i=_per_dim(dilation, n, [1]),
            ceil_mode_i=ceil_mode,
            outputs=2,
        )
        values = g.op("Gather", g.op("Reshape", x, _ints(g, [-1])), flat_indices, axis_i=0)
        if not with_indices:
            return values
        # ONNX indices count over the whole tensor, eager's within one (n, c) plane
        plane = g.op("ReduceProd", _dims(g, x, 2), keepdims_i=0)
        return values, g.op("Mod", flat_indices, plane)

    return symbolic


def _avg_pool(n: int) -> Any:
    def symbolic(
        g: Any,
        x: Value,
        kernel: Value,
        stride: Value,
        padding: Value,
        ceil_mode: Value,
        count_include_pad: Value,
        divisor_override: Value = None,
    ) -> Value:
        # The engine's CPU AveragePoolGrad sizes its output from the node's static shape (empty
        # with dynamic dims) and ignores ceil_mode. A window sum is a Conv with a ones kernel
        # over (N*C, 1, spatial...), which the engine differentiates; the divisor map counts
        # the cells eager counts.
        kernel_ = _per_dim(_const_ints(kernel) or [], n)
        stride_ = _per_dim(_const_ints(stride) or [], n, kernel_)
        pad_ = _per_dim(_const_ints(padding) or [0], n)
        ceil = bool(sh._get_const(ceil_mode, "i", "ceil_mode"))
        include_pad = bool(sh._get_const(count_include_pad, "i", "count_include_pad"))
        divisor = (
            None
            if divisor_override is None or sh._is_none(divisor_override)
            else sh._get_const(divisor_override, "i", "divisor_override")
        )
        like = _float_type(x)
        dtype = _TORCH_TYPE[like]
        planes = g.op("Reshape", x, _concat(g, _ints(g, [-1, 1]), _dims(g, x, 2)))
        extra = _ceil_extra(g, x, kernel_, stride_, pad_) if ceil else None
        ones_kernel = g.op("Constant", value_t=torch.ones([1, 1, *kernel_], dtype=dtype))

        def window_sum(t: Value, pad_value: float, with_extra: bool) -> Value:
            begin = _ints(g, [0, 0, *pad_])
            end = _ints(g, [0, 0, *pad_])
            if with_extra and extra is not None:
                end = g.op("Add", end, _concat(g, _ints(g, [0, 0]), extra))
            padded = g.op("Pad", t, _concat(g, begin, end), _const(g, pad_value, dtype))
            return g.op("Conv", padded, ones_kernel, kernel_shape_i=kernel_, strides_i=stride_)

        sums = window_sum(planes, 0.0, True)
        if divisor is not None:
            out = g.op("Div", sums, _const(g, float(divisor), dtype))
        elif include_pad and not ceil:
            size = 1
            for k in kernel_:
                size *= k
            out = g.op("Div", sums, _const(g, float(size), dtype))
        else:
            cells = g.op(
                "ConstantOfShape",
                _concat(g, _ints(g, [1, 1]), _dims(g, x, 2)),
                value_t=torch.tensor([1.0], dtype=dtype),
            )
            if include_pad:  # padding counts, the ceil overhang does not
                cells = g.op(
                    "Pad", cells, _ints(g, [0, 0, *pad_, 0, 0, *pad_]), _const(g, 1.0, dtype)
                )
                end = _concat(g, _ints(g, [0, 0]), extra)
                cells = g.op(
                    "Pad", cells, _concat(g, _ints(g, [0] * (n + 2)), end), _const(g, 0.0, dtype)
                )
                counts = g.op("Conv", cells, ones_kernel, kernel_shape_i=kernel_, strides_i=stride_)
            else:
                counts = window_sum(cells, 0.0, True)
            out = g.op("Div", sums, counts)
        return g.op("Reshape", out, _concat(g, _dims(g, x, 0, 2), _dims(g, out, 2)))

    return symbolic


def _ceil_extra(
    g: Any, x: Value, kernel: list[int], stride: list[int], padding: list[int]
) -> Value:
    """Right padding that makes a floor-mode window count equal eager's ceil-mode count:
    out = ceil((in + 2p - k) / s) + 1, less one when the last window starts past in + p."""
    sizes = _dims(g, x, 2)
    k, s, p = _ints(g, kernel), _ints(g, stride), _ints(g, padding)
    span = g.op("Sub", g.op("Add", sizes, g.op("Mul", p, _ints(g, [2] * len(kernel)))), k)
    out = g.op(
        "Add",
        g.op("Div", g.op("Add", span, g.op("Sub", s, _ints(g, [1] * len(kernel)))), s),
        _ints(g, [1] * len(kernel)),
    )
    last_start = g.op("Mul", g.op("Sub", out, _ints(g, [1] * len(kernel))), s)
    past = g.op("GreaterOrEqual", last_start, g.op("Add", sizes, p))
    out = g.op("Sub", out, _cast(g, past, "Long"))
    needed = g.op("Add", g.op("Mul", g.op("Sub", out, _ints(g, [1] * len(kernel))), s), k)
    have = g.op("Add", sizes, g.op("Mul", p, _ints(g, [2] * len(kernel))))
    return g.op("Max", g.op("Sub", needed, have), _ints(g, [0] * len(kernel)))


def _adaptive_bounds(g: Any, in_size: Value, out_size: int) -> tuple[Value, Value]:
    """Eager's adaptive window [start, end) per output cell, as int64 vectors of length out."""
    zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
    cells = g.op("Range", zero, _const(g, out_size, torch.int64), one)
    o = _const(g, out_size, torch.int64)
    start = g.op("Div", g.op("Mul", cells, in_size), o)
    end = g.op(
        "Div", g.op("Sub", g.op("Add", g.op("Mul", g.op("Add", cells, one), in_size), o), one), o
    )
    return start, end


def _adaptive_avg_pool(n: int) -> Any:
    @sh.parse_args("v", "is")
    def symbolic(g: Any, x: Value, output_size: list[int]) -> Value:
        # The default export works only for output size 1 (GlobalAveragePool). Each spatial
        # axis is an (out, in) averaging matrix applied with MatMul, built from the run-time
        # input size.
        rank = _rank(x, f"aten::adaptive_avg_pool{n}d")
        sizes = _per_dim(output_size, n)
        if all(s == 1 for s in sizes):
            return g.op("GlobalAveragePool", x)
        like = _float_type(x)
        zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
        y = x
        for i, out in enumerate(sizes):
            axis = rank - n + i
            in_size = _dim_scalar(g, x, axis)
            start, end = _adaptive_bounds(g, in_size, out)
            j = _unsqueeze(g, g.op("Range", zero, in_size, one), [0])
            inside = g.op(
                "And",
                g.op("GreaterOrEqual", j, _unsqueeze(g, start, [1])),
                g.op("Less", j, _unsqueeze(g, end, [1])),
            )
            width = _cast(g, _unsqueeze(g, g.op("Sub", end, start), [1]), like)
            matrix = g.op("Div", _cast(g, inside, like), width)  # (out, in)
            y = _along_axis(g, y, matrix, axis, rank)
        return y

    return symbolic


def _along_axis(g: Any, x: Value, matrix: Value, axis: int, rank: int) -> Value:
    """Apply an (out, in) matrix to ``axis`` of x."""
    if axis == rank - 1:
        return g.op("MatMul", x, g.op("Transpose", matrix, perm_i=[1, 0]))
    if axis == rank - 2:
        return g.op("MatMul", matrix, x)
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    moved = g.op(
        "MatMul", g.op("Transpose", x, perm_i=perm), g.op("Transpose", matrix, perm_i=[1, 0])
    )
    return g.op("Transpose", moved, perm_i=perm)


def _adaptive_max_pool(n: int) -> Any:
    @sh.parse_args("v", "is")
    def symbolic(g: Any, x: Value, output_size: list[int]) -> tuple[Value, Value]:
        # The default export has no gradient (GlobalMaxPool) or fails with dynamic dims. The
        # argmax of each window is found axis by axis (last axis first, so ties resolve to the
        # first element in row-major order as in eager); the values are then gathered from the
        # flattened input, and Gather's gradient routes each cell's gradient to its argmax.
        rank = _rank(x, f"aten::adaptive_max_pool{n}d")
        sizes = _per_dim(output_size, n)
        zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
        reduced = x
        chosen: dict[int, Value] = {}  # spatial axis -> absolute index, shaped like `reduced`
        for i in reversed(range(n)):
            axis = rank - n + i
            in_size = _dim_scalar(g, x, axis)
            start, end = _adaptive_bounds(g, in_size, sizes[i])
            longest = _reduce(g, "ReduceMax", g.op("Sub", end, start), None, keepdims=False)
            offsets = _unsqueeze(g, g.op("Range", zero, longest, one), [0])
            window = g.op(
                "Min",
                g.op("Add", _unsqueeze(g, start, [1]), offsets),
                _unsqueeze(g, g.op("Sub", end, one), [1]),
            )
            gathered = g.op("Gather", reduced, window, axis_i=axis)  # (..., out, L, ...)
            values, local = g.op(
                "TopK", gathered, _ints(g, [1]), axis_i=axis + 1, largest_i=1, sorted_i=1, outputs=2
            )
            reduced = _squeeze(g, values, [axis + 1])
            local = _squeeze(g, local, [axis + 1])
            trailing = list(range(1, rank - axis))
            absolute = g.op("Add", local, _unsqueeze(g, start, trailing) if trailing else start)
            for done, index in chosen.items():
                chosen[done] = g.op("GatherElements", index, absolute, axis_i=axis)
            chosen[axis] = absolute
        plane = None
        for i in range(n):
            axis = rank - n + i
            index = chosen[axis]
            plane = (
                index
                if plane is None
                else g.op("Add", g.op("Mul", plane, _dim_scalar(g, x, axis)), index)
            )
        assert plane is not None
        plane_size = g.op("ReduceProd", _dims(g, x, rank - n), keepdims_i=0)
        leading = g.op("ReduceProd", _dims(g, x, 0, rank - n), keepdims_i=0)
        base = g.op("Mul", g.op("Range", zero, leading, one), plane_size)
        base = g.op("Reshape", base, _concat(g, _dims(g, x, 0, rank - n), _ints(g, [1] * n)))
        flat_index = g.op("Add", base, plane)
        values = g.op("Gather", g.op("Reshape", x, _ints(g, [-1])), flat_index, axis_i=0)
        return values, plane

    return symbolic
