"""Normalization symbolics: ``layer_norm`` (LayerNormalization, opset 17+) and ``group_norm``."""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import _TORCH_TYPE, Value, _dims, _float_type, _ints, _rank, _shape, _unsqueeze

# -- normalization ---------------------------------------------------------------------------


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
    y, _mean, _inv_std = g.op(
        "LayerNormalization", x, weight, bias, epsilon_f=eps, axis_i=-len(shape), outputs=3
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
        "LayerNormalization", grouped, ones, zeros, epsilon_f=eps, axis_i=-1, outputs=3
    )
    y = g.op("Reshape", y, _shape(g, x))
    per_channel = list(range(1, rank - 1))
    if not sh._is_none(weight):
        y = g.op("Mul", y, _unsqueeze(g, weight, per_channel))
    if not sh._is_none(bias):
        y = g.op("Add", y, _unsqueeze(g, bias, per_channel))
    return y
