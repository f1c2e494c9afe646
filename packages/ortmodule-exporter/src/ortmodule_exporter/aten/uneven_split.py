"""``split`` with an uneven last chunk runs in PyTorch (an untrainable check).

PyTorch's ONNX symbolic for ``torch.split(x, size, dim)`` writes the chunk sizes as
``[size] * n`` when the dimension is dynamic, which ORTModule's exports are: ``torch.split(x, 2)``
on a dimension of 5 becomes ``Split(split=[2, 2, 2])`` and the engine refuses it at run time
("Sum of sizes in 'split' (must equal size of selected axis) was 6"). Where the traced size is
not a multiple of ``size``, the operator becomes an ATen node instead; its list output is
unpacked by the ATen pass.

>>> from ortmodule_exporter.aten import uneven_split
>>> uneven_split.install()  # done on import of ortmodule_exporter
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .empty_tensors import known_sizes
from .symbolic_helpers import traced_constant
from .untrainable import register_untrainable_check

__all__ = ["install", "uneven_split_reasons"]

_SPLITS = frozenset({"aten::split", "aten::unsafe_split"})


def _constant_int(value: Any) -> int | None:
    """The integer a traced constant holds (a number or a one-element integer tensor)."""
    tensor = traced_constant(value)
    if tensor is None or tensor.numel() != 1 or tensor.is_floating_point():
        return None
    return int(tensor.item())


def uneven_split_reasons(node: Any, inputs: Sequence[Any], emitted: Sequence[Any]) -> list[str]:
    """``[reason]`` when ``node`` splits a dimension of known size into chunks of a constant
    size that does not divide it; else ``[]``."""
    if node.kind() not in _SPLITS or node.inputsSize() < 3:
        return []
    size, dim = _constant_int(node.inputsAt(1)), _constant_int(node.inputsAt(2))
    sizes = known_sizes(node.inputsAt(0))
    if size is None or dim is None or sizes is None or not -len(sizes) <= dim < len(sizes):
        return []
    length = sizes[dim]
    if length is None or size <= 0 or length % size == 0:
        return []
    # ends in "tensor": the forward fails too, so inference exports take the route as well
    return [f"{node.kind()} with an uneven last chunk of the split tensor"]


def install() -> None:
    """Route such splits to ATen in every ORTModule export."""
    register_untrainable_check(uneven_split_reasons)
