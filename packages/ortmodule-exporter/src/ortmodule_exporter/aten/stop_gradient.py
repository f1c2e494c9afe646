"""A copy of a tensor with no gradient path back, as an ATen node the engine never differentiates.

The engine's ``BatchNormalization`` stop-gradient
(:func:`~ortmodule_exporter.symbolics.helpers._stop_gradient`) has CPU kernels for float32 and
float16 only; :data:`STOP_GRADIENT` serves the other floating types (float64, bfloat16). Its
input is a stop-gradient edge, so the engine builds no backward for it.
"""

from __future__ import annotations

import torch

from .executor import AtenFunction, register_aten_function
from .gradients import register_stop_gradient_edges
from .output_shapes import input_shape, register_output_shapes

__all__ = ["STOP_GRADIENT"]

STOP_GRADIENT = "_ortmodule_stop_gradient"


def _copy(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    (x,) = inputs
    assert x is not None
    # a copy, not a view: the engine owns its output buffer
    return [x.clone()]


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


register_aten_function(STOP_GRADIENT, AtenFunction(_copy, _all_tensors))
register_stop_gradient_edges(STOP_GRADIENT, "", [0])
register_output_shapes(STOP_GRADIENT, input_shape)
