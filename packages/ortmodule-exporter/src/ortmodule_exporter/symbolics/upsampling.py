"""Upsampling symbolics: nearest, nearest-exact, linear, bilinear, trilinear and bicubic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    Value,
    _cast,
    _const,
    _const_ints,
    _dim_scalar,
    _float_type,
    _ints,
    _rank,
    _unsqueeze,
)

# -- upsampling ------------------------------------------------------------------------------


class _Upsample:
    """upsample_* as per-axis Gathers of source rows mixed by weights (the engine's Resize
    gradient has no CPU kernel). Index and weight arithmetic follows ATen's CPU kernels."""

    def __init__(self, g: Any, x: Value, n: int, mode: str, align_corners: bool) -> None:
        self.g, self.x, self.n, self.mode, self.align = g, x, n, mode, align_corners
        self.rank = _rank(x, f"aten::upsample ({mode})")
        self.like = _float_type(x)

    def run(self, out_sizes: list[Value | int], scales: list[float | None]) -> Value:
        y = self.x
        for i in range(self.n):
            axis = self.rank - self.n + i
            y = self._axis(y, axis, out_sizes[i], scales[i])
        return y

    def _axis(self, y: Value, axis: int, out_size: Value | int, scale: float | None) -> Value:
        g = self.g
        f32 = torch.float32
        in_size = _dim_scalar(g, self.x, axis)
        in_f = _cast(g, in_size, "Float")
        out = _const(g, out_size, torch.int64) if isinstance(out_size, int) else out_size
        out_f = _cast(g, out, "Float")
        zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
        dst = _cast(g, g.op("Range", zero, out, one), "Float")
        last = g.op("Sub", in_size, one)
        if self.align and self.mode != "nearest":
            ratio = g.op(
                "Div",
                g.op("Sub", in_f, _const(g, 1.0, f32)),
                g.op("Sub", out_f, _const(g, 1.0, f32)),
            )
            ratio = g.op("Where", g.op("Greater", out, one), ratio, _const(g, 0.0, f32))
        elif scale is not None and scale > 0:
            ratio = _const(g, float(torch.tensor(1.0 / scale, dtype=torch.float32)), f32)
        else:
            ratio = g.op("Div", in_f, out_f)

        if self.mode in ("nearest", "nearest-exact"):
            src = dst if self.mode == "nearest" else g.op("Add", dst, _const(g, 0.5, f32))
            index = _cast(g, g.op("Floor", g.op("Mul", src, ratio)), "Long")
            return g.op("Gather", y, g.op("Min", index, last), axis_i=axis)

        if self.align:
            real = g.op("Mul", ratio, dst)
        else:
            real = g.op(
                "Sub",
                g.op("Mul", ratio, g.op("Add", dst, _const(g, 0.5, f32))),
                _const(g, 0.5, f32),
            )
            if self.mode == "linear":
                real = g.op("Max", real, _const(g, 0.0, f32))
        base = g.op("Min", _cast(g, g.op("Floor", real), "Long"), last)
        t = g.op("Sub", real, _cast(g, base, "Float"))
        t = g.op("Min", g.op("Max", t, _const(g, 0.0, f32)), _const(g, 1.0, f32))
        if self.mode == "linear":
            taps = [
                (base, g.op("Sub", _const(g, 1.0, f32), t)),
                (g.op("Min", g.op("Add", base, one), last), t),
            ]
        else:
            taps = [
                (
                    g.op(
                        "Min",
                        g.op("Max", g.op("Add", base, _const(g, k - 1, torch.int64)), zero),
                        last,
                    ),
                    w,
                )
                for k, w in enumerate(self._cubic_weights(t))
            ]
        trailing = list(range(1, self.rank - axis))
        total = None
        for index, weight in taps:
            weight = _cast(g, weight, self.like)
            if trailing:
                weight = _unsqueeze(g, weight, trailing)
            term = g.op("Mul", g.op("Gather", y, index, axis_i=axis), weight)
            total = term if total is None else g.op("Add", total, term)
        return total

    def _cubic_weights(self, t: Value) -> list[Value]:
        """Keys' cubic convolution weights with A = -0.75, as ATen."""
        g = self.g
        a = -0.75

        def c(v: float) -> Value:
            return _const(g, v, torch.float32)

        def near(x: Value) -> Value:  # |x| <= 1: ((A + 2) x - (A + 3)) x^2 + 1
            inner = g.op("Sub", g.op("Mul", c(a + 2), x), c(a + 3))
            return g.op("Add", g.op("Mul", g.op("Mul", inner, x), x), c(1.0))

        def far(x: Value) -> Value:  # 1 < |x| < 2: ((A x - 5A) x + 8A) x - 4A
            inner = g.op(
                "Add", g.op("Mul", g.op("Sub", g.op("Mul", c(a), x), c(5 * a)), x), c(8 * a)
            )
            return g.op("Sub", g.op("Mul", inner, x), c(4 * a))

        one_minus = g.op("Sub", c(1.0), t)
        return [
            far(g.op("Add", t, c(1.0))),
            near(t),
            near(one_minus),
            far(g.op("Add", one_minus, c(1.0))),
        ]


def _upsample(n: int, mode: str) -> Any:
    def symbolic(g: Any, x: Value, output_size: Value, *args: Value) -> Value:
        # aten::upsample_*: (input, output_size, [align_corners,] scale_factors) for the .vec
        # overload, or per-axis optional scales for the sized overload.
        if mode in ("linear", "cubic"):
            align = bool(sh._get_const(args[0], "b", "align_corners"))
            rest = args[1:]
        else:
            align, rest = False, args
        scales = _upsample_scales(rest, n)
        sizes = _upsample_sizes(g, x, output_size, scales, n)
        return _Upsample(g, x, n, mode, align).run(sizes, scales)

    return symbolic


def _upsample_scales(args: Sequence[Value], n: int) -> list[float | None]:
    """Per-axis scale factors: one float list (the .vec overload) or one optional per axis."""
    if len(args) == 1:
        v = args[0]
        if v is None or sh._is_none(v):
            return [None] * n
        parsed = sh._maybe_get_const(v, "fs")
        if not isinstance(parsed, list):
            raise ValueError("aten::upsample: scale factors must be constants")
        scales: list[float | None] = [float(s) for s in parsed]
        return scales * n if len(scales) == 1 else scales
    return [
        None if a is None or sh._is_none(a) else float(sh._get_const(a, "f", "scale"))
        for a in args[-n:]
    ]


def _upsample_sizes(
    g: Any, x: Value, output_size: Value, scales: list[float | None], n: int
) -> list[Value | int]:
    rank = _rank(x, "aten::upsample")
    if output_size is not None and not sh._is_none(output_size):
        constant = _const_ints(output_size)
        if constant is not None:
            return constant * n if len(constant) == 1 else list(constant)
        if sh._is_packed_list(output_size):
            return [
                g.op("Reshape", _cast(g, v, "Long"), _ints(g, []))
                for v in sh._unpack_list(output_size)
            ]
        return [g.op("Gather", output_size, _const(g, i, torch.int64)) for i in range(n)]
    sizes: list[Value | int] = []
    for i, scale in enumerate(scales):
        if scale is None:
            raise ValueError("aten::upsample: needs an output size or scale factors")
        in_size = _cast(g, _dim_scalar(g, x, rank - n + i), "Double")
        scaled = g.op("Floor", g.op("Mul", in_size, _const(g, scale, torch.float64)))
        sizes.append(_cast(g, scaled, "Long"))
    return sizes
