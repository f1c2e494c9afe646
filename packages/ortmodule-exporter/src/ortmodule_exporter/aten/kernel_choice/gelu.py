"""GELU (``none`` and ``tanh``): the engine's ``Gelu``/``GeluGrad`` (``FastGelu``/``FastGeluGrad``)
or PyTorch's ``gelu`` and ``gelu_backward`` as ATen nodes, run in pieces across the engine's
threads (``aten/parallel.py``). Sized by the exported value's elements when known, else at
:data:`~ortmodule_exporter.aten.kernel_choice.CALIBRATION_NUMEL`.

>>> from ortmodule_exporter.aten.kernel_choice import measure_gelu
>>> engine_us, torch_us = measure_gelu(1 << 14)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ...torchscript_onnx import symbolic_helper as sh
from ..executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from ..gradients import GradientNode, register_aten_gradient
from ..output_shapes import input_shape, register_output_shapes
from ..parallel import elementwise
from .choice import choose
from .fx_nodes import AtenChoice, fx_arg, fx_float32, fx_sizes, register_fx_kernel_choice
from .helpers import _all_tensors, _dtype
from .measuring import _engine_us, _randn, _seeded, _torch_us
from .registry import CoveredOperator, _opset9, register_kernel_choice
from .traced import _complete_sizes

GELU = "_ortmodule_gelu"
GELU_BACKWARD = "_ortmodule_gelu_backward"


def _gelu(approximate: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    (x,) = inputs
    assert x is not None
    return [elementwise(torch.ops.aten.gelu.out, [x], approximate=approximate or "none")]


def _gelu_backward(
    approximate: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x = inputs
    assert grad is not None and x is not None
    op = torch.ops.aten.gelu_backward.grad_input
    return [elementwise(op, [grad, x], "grad_input", approximate=approximate or "none")]


register_aten_function(GELU, AtenFunction(_gelu, _all_tensors))
register_aten_function(GELU_BACKWARD, AtenFunction(_gelu_backward, _all_tensors))
# this route's node and PyTorch's own aten::gelu (the exporter's ATen fallback)
register_output_shapes(GELU, input_shape)
register_output_shapes("gelu", input_shape)
for _approximate in ("none", "tanh"):
    register_aten_gradient(
        GELU,
        _approximate,
        [GradientNode.aten(GELU_BACKWARD, ["GO(0)", "I(0)"], ["GI(0)"], overload=_approximate)],
    )


def measure_gelu(numel: int, approximate: str = "none") -> tuple[float, float]:
    """Microseconds of GELU forward + backward on ``numel`` float32 elements: (engine, torch).

    The engine side is its ``Gelu`` and ``GeluGrad`` kernels in one session (what the engine
    fuses an exported GELU into); the torch side adds the two ATen nodes' own cost.
    """
    from onnx import helper

    fast = approximate != "none"
    nodes = [
        helper.make_node("FastGelu" if fast else "Gelu", ["x"], ["y"], domain="com.microsoft"),
        helper.make_node(
            "FastGeluGrad" if fast else "GeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft"
        ),
    ]
    _seeded()
    x, dy = _randn(numel), _randn(numel)
    engine_us = _engine_us("gelu", nodes, {"x": x, "dy": dy}, ["y", "dx"])

    def torch_route() -> None:
        _gelu(approximate, [x])
        _gelu_backward(approximate, [dy, x])

    return engine_us, _torch_us(torch_route, engine_us=engine_us)


#: the engine's GELU gradient node for each ``approximate``
ENGINE_GELU_GRADS = {"none": "GeluGrad", "tanh": "FastGeluGrad"}


def measure_gelu_backward(numel: int, approximate: str = "none") -> tuple[float, float]:
    """Microseconds of GELU's backward alone on ``numel`` float32 elements: (engine, torch).
    The engine's ``GeluGrad``/``FastGeluGrad`` against PyTorch's ``gelu_backward`` and one ATen
    node's cost. For the engine's gradient of a GELU it fused itself (``passes/gelu_grads.py``:
    Hugging Face GPT-2's ``NewGELUActivation``, traced as ``tanh`` arithmetic)."""
    from onnx import helper

    node = helper.make_node(
        ENGINE_GELU_GRADS[approximate], ["dy", "x"], ["dx"], domain="com.microsoft"
    )
    _seeded()
    x, dy = _randn(numel), _randn(numel)
    engine_us = _engine_us("gelu_backward", [node], {"x": x, "dy": dy}, ["dx"])
    return engine_us, _torch_us(
        lambda: _gelu_backward(approximate, [dy, x]), aten_nodes=1, engine_us=engine_us
    )


def gelu_backward_route(numel: int | None, approximate: str) -> str:
    """``"engine"`` or ``"torch"`` for the engine's GELU gradient node over ``numel`` float32
    elements (None: unknown, timed at the calibration size)."""
    return choose(
        f"gelu_backward({approximate})",
        "Float",
        numel,
        lambda n: measure_gelu_backward(n, approximate=approximate),
        # a backward node: recompute repeats forward nodes only, so it stays measured there
        backward_only=True,
    )


def _numel(value: Any) -> int | None:
    sizes = _complete_sizes(value)
    return math.prod(sizes) if sizes is not None else None


def _gelu_symbolic(default: Callable[..., Any], g: Any, self: Any, approximate: Any = None) -> Any:
    approx = "none" if approximate is None else sh._maybe_get_const(approximate, "s")
    dtype = _dtype(self)
    if approx not in ("none", "tanh") or dtype != "Float":
        return default(g, self, approximate)
    route = choose(
        f"gelu({approx})", dtype, _numel(self), lambda n: measure_gelu(n, approximate=approx)
    )
    if route != "torch":
        return default(g, self, approximate)
    out = g.op(f"{ATEN_DOMAIN}::ATen", self, operator_s=GELU, overload_name_s=approx, outputs=1)
    out.setType(self.type())
    return out


register_kernel_choice(CoveredOperator("aten::gelu", _gelu_symbolic, _opset9("gelu")))


def _gelu_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`_gelu_symbolic`: sized by the exported value's static
    sizes (a dynamic dim: unknown, as the TorchScript graph's are)."""
    x, approx = fx_arg(node, 0, "self"), fx_arg(node, 1, "approximate", "none")
    if approx not in ("none", "tanh") or not fx_float32(x):
        return None
    numel = _static_numel(x)
    route = choose(f"gelu({approx})", "Float", numel, lambda n: measure_gelu(n, approximate=approx))
    return AtenChoice(GELU, approx, (x,)) if route == "torch" else None


def _static_numel(value: Any) -> int | None:
    sizes = fx_sizes(value, symbolic=False)
    return math.prod(sizes) if sizes is not None else None


register_fx_kernel_choice([torch.ops.aten.gelu.default], _gelu_fx)
