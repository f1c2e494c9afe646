"""ONNX nodes whose gradient the engine builds wrong or not at all, though it has a builder.

:func:`~ortmodule_exporter.aten.untrainable.untrainable_nodes` routes op types the engine has no
gradient builder for. These have one that fails for some of their inputs or attributes, so
the operator that emitted them runs in PyTorch (an ATen node) in training exports:

* ``Pow`` with a computed exponent: "GradientBuilder is not implemented for Pow's input
  exponent" (``pow(x, y)``, ``2 ** x``);
* ``Pad`` in ``reflect``/``edge``/``wrap`` mode: "Pad gradient currently supports constant mode
  only";
* ``ReduceL2``: its gradient graph leaves a value untyped ("does not have type information set
  by parent node"; ``norm``, ``linalg.norm``);
* ``Slice`` with a negative step (``flip``): SliceGrad fails with ``narrowing_error``;
* ``clamp`` (``Clip``) with a bound that needs a gradient (``clamp_min(x, t)``): the engine's
  Clip gradient is for the input only ("failed to find NodeArg by name: t_grad").

Only float paths count: an integer ``Slice`` or ``Pow`` needs no gradient.

>>> from ortmodule_exporter.aten import gradient_gaps
>>> gradient_gaps.install()  # done on import of ortmodule_exporter
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .symbolic_helpers import maybe_float, traced_constant, traced_requires_grad
from .untrainable import register_untrainable_check

__all__ = ["gradient_gap_reasons", "install"]


def _gap(n: Any) -> str | None:
    op = n.kind().split("::", 1)[1]
    if n.inputsSize() == 0 or not maybe_float(n.inputsAt(0)):
        return None
    if op == "Pow" and n.inputsSize() > 1 and traced_constant(n.inputsAt(1)) is None:
        return "Pow's exponent (the engine has no gradient for it)"
    if op == "Pad" and n.hasAttribute("mode") and n.s("mode") != "constant":
        return f"Pad mode={n.s('mode')} (the engine's gradient is for constant mode only)"
    if op == "ReduceL2":
        return "ReduceL2 (the engine's gradient graph loses a type)"
    if op == "Slice" and n.inputsSize() > 4:
        # only a step known to be negative (flip): a step computed at run time is, in practice,
        # 1 (rotate_half in every Llama-style attention), and routing it cost 4 PythonOps a layer
        steps = traced_constant(n.inputsAt(4))
        if steps is not None and bool((steps < 0).any()):
            return "Slice with a negative step (the engine's SliceGrad fails)"
    return None


_CLAMPS = frozenset({"aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::clip"})


def gradient_gap_reasons(node: Any, inputs: Sequence[Any], emitted: Sequence[Any]) -> list[str]:
    """The gaps among the ONNX nodes ``emitted`` for ``node`` (see the module docstring)."""
    gaps = [gap for n in emitted if (gap := _gap(n)) is not None]
    clips = any(n.kind() == "onnx::Clip" for n in emitted)
    if (
        clips
        and node.kind() in _CLAMPS
        and any(
            v.type().kind() == "TensorType"
            and traced_constant(v) is None
            and v.node().kind() != "prim::Constant"
            and traced_requires_grad(v)
            for v in list(node.inputs())[1:]
        )
    ):
        gaps.append("clamp with a bound that needs a gradient (Clip's is for its input only)")
    return gaps


def install() -> None:
    """Route operators that emit such nodes to ATen in training exports."""
    register_untrainable_check(gradient_gap_reasons)
