"""Normalization symbolics: ``layer_norm`` (LayerNormalization, opset 17+) and ``group_norm``."""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _TORCH_TYPE,
    Value,
    _dims,
    _float_type,
    _ints,
    _rank,
    _reduce,
    _shape,
    _unsqueeze,
)

# -- normalization ---------------------------------------------------------------------------


def _centred(g: Any, x: Value, axes: list[int]) -> Value:
    """``x`` minus its mean over ``axes``, for a float32 LayerNormalization.

    The engine's CPU LayerNormalization (1.19.2) takes the variance as ``E[x^2] - E[x]^2`` in
    float32, which cancels when the mean is large against the spread (``nn.LayerNorm(2)`` of
    the row ``[10, 10.003]``: 0.4744 for eager's 0.4286). Centred, ``E[x]`` is about 0 and the
    variance as exact as eager's; output and gradient are the same functions (a normalization
    does not see a shift). Cost: one ReduceMean and one Sub per normalization, and their
    gradients. float64 is computed in float64 and float16/bfloat16 in float32 (``stash_type``),
    where the cancellation stays below their own rounding: left as they are.
    """
    if _float_type(x) != "Float":
        return x
    return g.op("Sub", x, _reduce(g, "ReduceMean", x, axes, keepdims=True))


@sh.parse_args("v", "is", "v", "v", "f", "b")
def layer_norm(
    g: Any, x: Value, shape: list[int], weight: Value, bias: Value, eps: float, _cudnn: bool
) -> Value:
    # The engine's LayerNormalizationGrad consumes the saved mean and inverse std-dev, so the
    # forward node must produce all three outputs (the default export keeps only the first).
    dtype = _TORCH_TYPE[_float_type(x)]
    if sh._is_none(weight):
        weight = g.op("Constant", value_t=torch.ones(shape, dtype=dtype))
    if sh._is_none(bias):
        bias = g.op("Constant", value_t=torch.zeros(shape, dtype=dtype))
    centred = _centred(g, x, list(range(-len(shape), 0)))
    y, _mean, _inv_std = g.op(
        "LayerNormalization", centred, weight, bias, epsilon_f=eps, axis_i=-len(shape), outputs=3
    )
    return y


@sh.parse_args("v", "i", "v", "v", "f", "b")
def group_norm(
    g: Any, x: Value, groups: int, weight: Value, bias: Value, eps: float, _cudnn: bool
) -> Value:
    # The default export uses InstanceNormalization, which the engine cannot differentiate.
    # Normalizing (N, G, C/G * spatial) over its last axis is the same computation, done by the
    # LayerNormalization kernel the engine has a gradient for.
    rank = _rank(x, "aten::group_norm")
    dtype = _TORCH_TYPE[_float_type(x)]
    grouped = g.op("Reshape", x, _ints(g, [0, groups, -1]))
    norm_size = _dims(g, grouped, 2)
    ones = g.op("ConstantOfShape", norm_size, value_t=torch.tensor([1.0], dtype=dtype))
    zeros = g.op("ConstantOfShape", norm_size, value_t=torch.tensor([0.0], dtype=dtype))
    y, _mean, _inv_std = g.op(
        "LayerNormalization",
        _centred(g, grouped, [-1]),
        ones,
        zeros,
        epsilon_f=eps,
        axis_i=-1,
        outputs=3,
    )
    y = g.op("Reshape", y, _shape(g, x))
    per_channel = list(range(1, rank - 1))
    if not sh._is_none(weight):
        y = g.op("Mul", y, _unsqueeze(g, weight, per_channel))
    if not sh._is_none(bias):
        y = g.op("Add", y, _unsqueeze(g, bias, per_channel))
    return y
