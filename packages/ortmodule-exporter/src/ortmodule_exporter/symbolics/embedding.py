"""The ``embedding`` symbolic (``padding_idx`` and ``scale_grad_by_freq`` included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _TORCH_TYPE,
    Value,
    _const,
    _dim,
    _float_type,
    _ints,
    _shape,
    _stop_gradient,
    _unsqueeze,
)

# -- embedding -------------------------------------------------------------------------------

#: ``route(g, weight, indices, padding_idx, scale_grad_by_freq)``: a value that replaces the
#: exported lookup (PyTorch's own, padding row and frequency scaling included), or None. The
#: kernel choice (:func:`ortmodule_exporter.aten.kernel_choice.embedding_route`) installs
#: itself here.
LOOKUP_ROUTE: list[Callable[[Any, Value, Value, int, bool], Any]] = [
    lambda g, weight, indices, padding_idx, scale_grad_by_freq: None
]


@sh.parse_args("v", "v", "i", "b", "b")
def embedding(
    g: Any, weight: Value, indices: Value, padding_idx: int, scale_grad_by_freq: bool, _sparse: bool
) -> Value:
    # The default export is a plain Gather: row padding_idx receives gradient and
    # scale_grad_by_freq is rejected. Eager gives the padding row no gradient and divides each
    # row's gradient by how often its index occurs in the batch; the forward value is always
    # the plain lookup.
    # PyTorch's kernels where the kernel choice measured them faster
    routed = LOOKUP_ROUTE[0](g, weight, indices, padding_idx, scale_grad_by_freq)
    if routed is not None:
        return routed
    has_padding = padding_idx >= 0
    if not has_padding and not scale_grad_by_freq:
        return g.op("Gather", weight, indices)
    rows = g.op("Gather", weight, indices)
    like = _float_type(weight)
    if has_padding:
        is_pad = g.op("Equal", indices, _const(g, padding_idx, torch.int64))
    if not scale_grad_by_freq:
        pad_row = _stop_gradient(g, g.op("Gather", weight, _const(g, padding_idx, torch.int64)))
        return g.op("Where", _unsqueeze(g, is_pad, [-1]), pad_row, rows)

    if g.opset < 16:
        raise ValueError(
            "aten::embedding: scale_grad_by_freq=True needs opset 16 or newer "
            "(ScatterElements with reduction='add'); export with opset >= 16"
        )
    flat = g.op("Reshape", indices, _ints(g, [-1]))
    vocab = _dim(g, weight, 0)
    zeros = g.op("ConstantOfShape", vocab, value_t=torch.tensor([0.0], dtype=_TORCH_TYPE[like]))
    ones = g.op(
        "ConstantOfShape", _shape(g, flat), value_t=torch.tensor([1.0], dtype=_TORCH_TYPE[like])
    )
    counts = g.op("ScatterElements", zeros, flat, ones, axis_i=0, reduction_s="add")
    scale = g.op("Reciprocal", g.op("Gather", counts, indices))
    if has_padding:
        scale = g.op("Where", is_pad, _const(g, 0.0, _TORCH_TYPE[like]), scale)
    # value: rows exactly; gradient: scale * incoming gradient
    frozen = _stop_gradient(g, rows)
    delta = g.op("Mul", g.op("Sub", rows, frozen), _unsqueeze(g, scale, [-1]))
    return g.op("Add", frozen, delta)
