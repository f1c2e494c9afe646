"""Shape symbolics: ``squeeze``, ``permute``, ``repeat_interleave``."""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset13
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


def permute(g: Any, x: Value, dims: Value) -> Value:
    # PyTorch's symbolic copies the dims into Transpose's perm as given, negative ones too
    # (``x.permute(0, -2, -1, 1)`` in Mamba-2's chunked scan); ONNX wants them in [0, rank),
    # and the engine's gradient build refuses the node ("Invalid attribute perm"). perm lists
    # every dim, so its length is the rank even where the input's rank is unknown.
    given: list[int] = sh._parse_arg(dims, "is")  # as PyTorch's symbolic parses them
    perm = [d % len(given) for d in given]
    if perm == list(range(len(perm))):
        return x
    return g.op("Transpose", x, perm_i=perm)


def repeat_interleave(
    g: Any, x: Value, repeats: Value, dim: Value = None, output_size: Value = None
) -> Value:
    # PyTorch's symbolic (opset 9 and 13) reads a constant dim as the tensor the Constant node
    # holds and normalises it with ``dim += rank``, in place: the Constant itself changes. The
    # trace pools equal constants, so every other use of that -1 changed too, e.g. the -1 of
    # ``view(b, s, -1, d)`` became rank-1, a Reshape baked to the traced head count of another
    # projection that failed at run time (glm's interleaved rotary). PyTorch gets a Constant
    # of its own to change.
    value = sh._maybe_get_const(dim, "t") if dim is not None else None
    if isinstance(value, torch.Tensor):
        dim = g.op("Constant", value_t=value.clone())
    return symbolic_opset13.repeat_interleave(g, x, repeats, dim, output_size)
