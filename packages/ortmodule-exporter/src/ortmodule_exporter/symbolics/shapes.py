"""Shape symbolics: ``squeeze``."""

from __future__ import annotations

from typing import Any

import torch

from .helpers import Value, _concat, _const, _const_ints, _ints, _rank, _shape

# -- shapes ----------------------------------------------------------------------------------


def squeeze(g: Any, x: Value, dim: Value = None) -> Value:
    # With dynamic dims the default export wraps squeeze(dim) in an If the engine cannot
    # build a gradient through (and squeeze(dims) does not export at all). Eager drops each
    # listed dim only when its size is 1, which a Reshape to the filtered shape does at run
    # time.
    if dim is None:
        return g.op("Squeeze", x)
    dims = _const_ints(dim)
    if dims is None:
        raise ValueError("aten::squeeze: the dims to squeeze must be constants")
    rank = _rank(x, "aten::squeeze")
    if rank == 0:
        return g.op("Identity", x)
    targets = {d % rank for d in dims}
    shape = _shape(g, x)
    keep = []
    for axis in range(rank):
        if axis in targets:
            size = g.op("Gather", shape, _ints(g, [axis]))
            keep.append(g.op("Not", g.op("Equal", size, _ints(g, [1]))))
        else:
            keep.append(_const(g, [True], torch.bool))
    new_shape = g.op("Compress", shape, _concat(g, *keep), axis_i=0)
    return g.op("Reshape", x, new_shape, allowzero_i=1)
