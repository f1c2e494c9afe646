"""The kept tokens' rows of a ``(batch, seq, ...)`` tensor, and back, as ATen nodes.

Padding elimination (:mod:`ortmodule_exporter.sparsity.padding`) moves tensors between the padded
``(batch, seq, ...)`` layout and ``(kept tokens, ...)`` rows. The two moves are each other's
gradient, and both are plain copies:

* :data:`TAKE_ROWS` ``(x, rows, inverse)``: ``x.reshape(batch * seq, ...)[rows]``;
* :data:`PUT_ROWS` ``(y, rows, inverse)``: ``(batch, seq, ...)`` with ``y``'s rows where they
  came from and zeros at the tokens left out.

``rows`` (kept token -> flat position) and ``inverse`` (``(batch, seq)``: flat position -> kept
row, or the number of kept rows for a token left out) are integer inputs without a gradient. The engine's own ``Gather`` would do, but its CPU gradient
(``GatherGrad``, a scatter-add) took 6.6 ms per call on a (1024, 256) float tensor: 125 ms of a
masked-LM step, more than the padding saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..aten.executor import AtenFunction, register_aten_function
from ..aten.gradients import GradientNode, register_aten_gradient, register_stop_gradient_edges
from ..aten.output_shapes import Shape, register_output_shapes

__all__ = ["PUT_ROWS", "TAKE_ROWS", "put_rows", "take_rows"]

TAKE_ROWS = "_ortmodule_take_rows"
PUT_ROWS = "_ortmodule_put_rows"


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x``'s (batch, seq) rows at flat positions ``rows``."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows)


def put_rows(y: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Shape ``inverse.shape + y.shape[1:]``: row ``inverse[b, s]`` of ``y``, zeros where it is
    ``len(y)`` (a token left out).

    One ``index_select`` over ``y`` and a zero row: 45 µs at (745, 256) -> (8, 128, 256) on one
    thread, against 119 µs for zeros and an ``index_copy_`` (most of it first-touching the
    zeros)."""
    padded = torch.cat([y, y.new_zeros((1, *y.shape[1:]))])
    return padded.index_select(0, inverse.reshape(-1)).view(*inverse.shape, *y.shape[1:])


def _take(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, rows, _inverse = inputs
    assert x is not None and rows is not None
    return [take_rows(x, rows)]


def _put(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    y, _rows, inverse = inputs
    assert y is not None and inverse is not None
    return [put_rows(y, inverse)]


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


def _register() -> None:
    register_aten_function(TAKE_ROWS, AtenFunction(_take, _all_tensors))
    register_aten_function(PUT_ROWS, AtenFunction(_put, _all_tensors))
    for forward, backward in ((TAKE_ROWS, PUT_ROWS), (PUT_ROWS, TAKE_ROWS)):
        register_aten_gradient(
            forward, "", [GradientNode.aten(backward, ["GO(0)", "I(1)", "I(2)"], ["GI(0)"])]
        )
        register_stop_gradient_edges(forward, "", [1, 2])
    register_output_shapes(TAKE_ROWS, _taken_shape)
    register_output_shapes(PUT_ROWS, _put_shape)


def _taken_shape(shapes: Sequence[Shape | None], _overload: str) -> list[Shape | None]:
    """(batch, seq, ...) -> (rows, ...)."""
    x, rows = shapes[0], shapes[1]
    if x is None or rows is None:
        return [None]
    return [[*rows[:1], *x[2:]]]


def _put_shape(shapes: Sequence[Shape | None], _overload: str) -> list[Shape | None]:
    """(rows, ...) -> (batch, seq, ...), the grid being the inverse index's shape."""
    y, inverse = shapes[0], shapes[2]
    if y is None or inverse is None:
        return [None]
    return [[*inverse, *y[1:]]]


_register()
