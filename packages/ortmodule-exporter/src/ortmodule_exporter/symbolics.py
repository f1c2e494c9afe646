"""The symbolics ORTModule needs so the engine can differentiate common operators.

Each one exists because PyTorch's default export is either not differentiable by the engine
(it drops outputs the gradient needs) or loses information the engine's fused kernels use.
"""

from __future__ import annotations

from typing import Any

from torch.onnx import symbolic_helper as sh

from .symbolic_registry import register_symbolic


@sh.parse_args("v", "is", "v", "v", "f", "b")
def layer_norm(g: Any, x: Any, shape: list[int], weight: Any, bias: Any, eps: float, _cudnn: bool) -> Any:
    # The engine's LayerNormalizationGrad consumes the saved mean and inverse std-dev, so the
    # forward node must produce all three outputs (the default export keeps only the first).
    if sh._is_none(weight):
        weight = g.op("Constant", value_t=_ones_like_last(shape))
    if sh._is_none(bias):
        bias = g.op("Constant", value_t=_zeros_like_last(shape))
    y, _mean, _inv_std = g.op(
        "LayerNormalization", x, weight, bias, epsilon_f=eps, axis_i=-len(shape), outputs=3
    )
    return y


def _ones_like_last(shape: list[int]) -> Any:
    import torch

    return torch.ones(shape, dtype=torch.float32)


def _zeros_like_last(shape: list[int]) -> Any:
    import torch

    return torch.zeros(shape, dtype=torch.float32)


def register_builtin_symbolics() -> None:
    register_symbolic("aten::layer_norm", layer_norm, 17)
