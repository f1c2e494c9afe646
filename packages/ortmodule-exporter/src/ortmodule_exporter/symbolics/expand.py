"""``expand`` symbolic: the target shape is read from the input, never a bare constant."""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset9
from .helpers import Value, _concat, _ints, _shape

# -- expand ----------------------------------------------------------------------------------


def expand(g: Any, x: Value, size: Value, implicit: Value = None) -> Value:
    # PyTorch's export writes the target with -1 made 1 (ONNX Expand broadcasts), a constant
    # when the sizes are. The engine's graph optimizer then drops an Expand whose constant
    # target it believes the input already has: x[:, 1::2].expand(-1, 2) of a (3, 3) input
    # (one column, dims unknown at build time) came back (3, 1), not (3, 2), with no error
    # (found by the differential fuzzer). Here the target is max(target, input dims): equal to
    # the target wherever expand is valid (each input dim is 1 or the target's), the input's
    # own dim where the target is -1, and never a constant the optimizer can compare.
    sizes = sh._maybe_get_const(size, "is")
    if not sh._is_value(sizes):
        target = g.op("Constant", value_t=torch.tensor(sizes, dtype=torch.int64))
        n = len(sizes)
    elif sh._is_packed_list(sizes):
        parts = [g.op("Reshape", s, _ints(g, [1])) for s in sh._unpack_list(sizes)]
        target = _concat(g, *[g.op("Cast", p, to_i=7) for p in parts])
        n = len(parts)
    else:
        target = sizes
        n = (sh._get_tensor_sizes(sizes) or [None])[0]
    rank = sh._get_tensor_rank(x)
    if n is None or rank is None:  # not seen in practice: PyTorch's own export then
        return symbolic_opset9.expand(g, x, size, implicit)
    own = _shape(g, x)
    if n > rank:  # new leading dims: the input counts as size 1 there
        own = _concat(g, _ints(g, [1] * (n - rank)), own)
    minus_one = g.op("Equal", target, _ints(g, [-1]))
    return g.op("Expand", x, g.op("Max", g.op("Where", minus_one, own, target), own))
