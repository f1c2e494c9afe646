"""``scaled_dot_product_attention`` and ``feature_dropout`` symbolics."""

from __future__ import annotations

from typing import Any

import torch

from ..aten.routes import aten_routes, native_dropout_node
from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _TORCH_TYPE,
    Value,
    _cast,
    _concat,
    _const,
    _dim,
    _dim_scalar,
    _dims,
    _float_type,
    _ints,
    _rank,
    _scalar_type,
    _unsqueeze,
)

# -- attention and dropout -------------------------------------------------------------------


def _dropout_train(g: Any, x: Value, p: float) -> Value:
    if aten_routes().dropout and 0.0 < p < 1.0:
        # ORTMODULE_ATEN_DROPOUT: eager's masks. Eager's attention with dropout on CPU is the
        # math path, dropout on the probabilities; feature dropout draws over (N, C, 1, 1)
        # as here over the ones tensor: the same draws as native_dropout on these shapes
        return native_dropout_node(g, x, p)
    # Dropout with its mask output, so the gradient reuses the forward's mask.
    ratio = _const(g, p, _TORCH_TYPE[_float_type(x)])
    y, _mask = g.op("Dropout", x, ratio, _const(g, True, torch.bool), outputs=2)
    return y


@sh.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
def scaled_dot_product_attention(
    g: Any,
    query: Value,
    key: Value,
    value: Value,
    attn_mask: Value = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Value = None,
    enable_gqa: bool = False,
) -> Value:
    # The default export's Dropout has no mask output, so no gradient graph can be built when
    # dropout_p > 0. Same math as eager: softmax(q k^T * scale + mask) -> dropout -> @ v.
    op = "aten::scaled_dot_product_attention"
    like = _float_type(query)
    dtype = _TORCH_TYPE[like]
    rank = _rank(key, op)
    if enable_gqa:
        key, value = _repeat_kv_heads(g, query, key, rank), _repeat_kv_heads(g, query, value, rank)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    scores = g.op("MatMul", query, g.op("Transpose", key, perm_i=perm))
    scale_value = _const_float(scale)
    if scale_value is None:
        head = _cast(g, _dim(g, query, -1), like)
        factor = g.op("Reciprocal", g.op("Sqrt", head))
    else:
        factor = _const(g, [scale_value], dtype)
    scores = g.op("Mul", scores, factor)
    neg_inf = _const(g, float("-inf"), dtype)
    boolean_mask = False
    if is_causal:
        if not sh._is_none(attn_mask):
            raise ValueError(f"{op}: is_causal and attn_mask cannot be set together")
        attn_mask = _causal_mask(g, query, key)
    if not sh._is_none(attn_mask):
        if _scalar_type(attn_mask) == "Bool":
            boolean_mask = True
            scores = g.op("Where", attn_mask, scores, neg_inf)
        else:
            scores = g.op("Add", scores, attn_mask)
    attn = g.op("Softmax", scores, axis_i=-1)
    if boolean_mask:
        # eager gives a fully masked row zero weights instead of 0/0
        attn = g.op("Where", g.op("IsNaN", attn), _const(g, 0.0, dtype), attn)
    if dropout_p > 0.0:
        attn = _dropout_train(g, attn, dropout_p)
    return g.op("MatMul", attn, value)


def _const_float(v: Value) -> float | None:
    if v is None or sh._is_none(v):
        return None
    return float(sh._get_const(v, "f", "scale"))


def _causal_mask(g: Any, query: Value, key: Value) -> Value:
    """(L, S) bool, True where key position <= query position (top-left aligned like eager)."""
    zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
    rows = g.op("Range", zero, _dim_scalar(g, query, -2), one)
    cols = g.op("Range", zero, _dim_scalar(g, key, -2), one)
    return g.op("GreaterOrEqual", _unsqueeze(g, rows, [1]), _unsqueeze(g, cols, [0]))


def _repeat_kv_heads(g: Any, query: Value, kv: Value, rank: int) -> Value:
    """repeat_interleave of the head axis (-3) up to the query's head count (enable_gqa)."""
    head_axis = rank - 3
    repeats = g.op("Div", _dim(g, query, head_axis), _dim(g, kv, head_axis))
    expanded = g.op(
        "Expand",
        _unsqueeze(g, kv, [head_axis + 1]),
        _concat(g, _dims(g, kv, 0, head_axis + 1), repeats, _dims(g, kv, head_axis + 1)),
    )
    return g.op(
        "Reshape",
        expanded,
        _concat(
            g, _dims(g, kv, 0, head_axis), _dim(g, query, head_axis), _dims(g, kv, head_axis + 1)
        ),
    )


@sh.parse_args("v", "f", "b")
def feature_dropout(g: Any, x: Value, p: float, train: bool) -> Value:
    # Dropout2d/3d: the default export refuses training mode. One Dropout over a ones tensor of
    # shape (N, C, 1, ...) gives the scaled per-channel mask; x * mask differentiates through
    # Mul with that same mask.
    if not train or p == 0.0:
        return x
    rank = _rank(x, "aten::feature_dropout")
    ones_shape = _concat(g, _dims(g, x, 0, 2), _ints(g, [1] * (rank - 2)))
    ones = g.op(
        "ConstantOfShape",
        ones_shape,
        value_t=torch.tensor([1.0], dtype=_TORCH_TYPE[_float_type(x)]),
    )
    return g.op("Mul", x, _dropout_train(g, ones, p))
