"""The output shapes of ATen nodes, from their inputs' shapes, for shape inference that does
not know the operator.

ONNX Runtime's symbolic shape inference (which ``export/shape_guards.py`` runs to name the dims
a size guard reads) knows a few ``aten`` operators; any other ATen node's outputs get fresh
dims. Where such an output meets its input again (a ``LayerNorm`` routed to PyTorch, added to
the residual it normalised), the inference merges the fresh dims into the input's and restarts
from the first node: once per such node, so a pass over the whole graph per layer (25 passes,
seconds, on GPT-2 small), and every input dim in a merge counts as unsure. A rule registered
here gives the outputs their shapes instead.

A rule takes the inputs' shapes (a list of dims, each an int, a symbol name or None; None for
an input whose shape is unknown or absent) and returns one shape per output, or None for an
output it cannot tell.

>>> register_output_shapes("_ortmodule_identity", lambda shapes: [shapes[0]])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

__all__ = ["Shape", "ShapeRule", "output_shape_rules", "register_output_shapes"]

Shape = Sequence[int | str | None]
ShapeRule = Callable[[Sequence[Shape | None]], Sequence[Shape | None]]

_RULES: dict[str, ShapeRule] = {}


def register_output_shapes(operator: str, rule: ShapeRule) -> None:
    """The shapes of the outputs of ATen nodes with ``operator=operator`` are ``rule(shapes)``."""
    _RULES[operator] = rule


def output_shape_rules() -> Mapping[str, ShapeRule]:
    """Every registered rule, by operator name (read-only)."""
    return MappingProxyType(_RULES)
