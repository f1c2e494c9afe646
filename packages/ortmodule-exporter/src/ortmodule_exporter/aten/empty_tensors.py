"""Operators on zero-element tensors run in PyTorch (as ATen nodes), not in the engine.

The engine's kernels and gradient builders mishandle empty tensors in many ways: Gemm asserts
``K_ > 0``, MatMul over an empty inner dimension returns uninitialised memory instead of zeros
(silently wrong), the Concat gradient's SplitTraining loses its lengths, broadcasting gradients
reshape a reduced ``{1,1,1}`` into the empty shape, SliceGrad and LayerNormGrad assert, and
Reshape with a 0 in its target shape copies a dimension. Rather than chase each kernel, an
operator whose inputs or outputs hold zero elements is exported as one ATen node, which PyTorch
runs and differentiates (an empty tensor costs nothing to compute either way).

The decision is made at export time from known shapes: traced intermediate values carry their
sizes, and the graph inputs (dynamic in the ONNX graph) are looked up in the example inputs of
the export (:func:`example_inputs`). ``ortmodule_pytree`` keeps the shape of an empty tensor in
the schema, so a call that turns an input empty, or non-empty, exports again. Graphs without
empty tensors are untouched, and so are unary elementwise operators, which the engine runs and
differentiates on empty tensors correctly.

>>> from ortmodule_exporter.aten import empty_tensors
>>> empty_tensors.install()  # done on import of ortmodule_exporter
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .symbolic_helpers import traced_sizes
from .untrainable import register_untrainable_check

__all__ = ["SAFE_ON_EMPTY", "example_inputs", "install", "is_zero_element", "zero_element_reasons"]

#: ONNX op types the engine runs and differentiates on empty tensors correctly: unary and
#: elementwise. Binary ones are left out: a broadcasting gradient (even against a constant, as
#: in ``x + 1``) reshapes a reduced {1,1} into the empty shape. Any other emitted node on an
#: empty tensor routes the operator.
SAFE_ON_EMPTY = frozenset(
    {
        "Constant", "Identity", "Cast", "Neg", "Abs", "Exp", "Log", "Cos", "Sin", "Tanh",
        "Sigmoid", "Relu", "Reciprocal", "Sqrt", "Sign", "Erf",
        "IsNaN", "IsInf", "Not",
    }
)  # fmt: skip

_LOCAL = threading.local()


@contextlib.contextmanager
def example_inputs(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """For one export: the graph's first inputs are ``tensors`` (their shapes decide)."""
    previous = getattr(_LOCAL, "shapes", None)
    _LOCAL.shapes = [tuple(t.shape) for t in tensors]
    try:
        yield
    finally:
        _LOCAL.shapes = previous


def known_sizes(value: Any) -> tuple[int | None, ...] | None:
    """A traced tensor's sizes (None where unknown), or None when it is not a tensor."""
    if value is None:
        return None
    if value.node().kind() == "prim::Param":
        shapes = getattr(_LOCAL, "shapes", None) or []
        offset = value.offset()
        return shapes[offset] if offset < len(shapes) else None
    sizes = traced_sizes(value)
    return tuple(sizes) if sizes is not None else None


def is_zero_element(value: Any) -> bool:
    """Whether a traced value is a tensor known to hold no element."""
    sizes = known_sizes(value)
    return sizes is not None and 0 in sizes


def zero_element_reasons(node: Any, inputs: Sequence[Any], emitted: Sequence[Any]) -> list[str]:
    """``["<op> on a zero-element tensor"]`` when ``node`` (a traced aten operator) reads or
    writes an empty tensor, with the ONNX nodes its symbolic ``emitted``; else ``[]``."""
    values = [*inputs, *node.inputs(), *node.outputs()]
    if not any(is_zero_element(v) for v in values):
        return []
    if all(n.kind().split("::", 1)[1] in SAFE_ON_EMPTY for n in emitted):
        return []
    return [f"{node.kind()} on a zero-element tensor"]


def install() -> None:
    """Route operators on zero-element tensors to ATen in every ORTModule export."""
    register_untrainable_check(zero_element_reasons)
