"""Row sums (a bias's gradient): the built-graph pass ``passes/row_sums.py`` turns the engine's
``ReduceSum`` over a batch's leading axes into an ATen node where :func:`row_sum_route` timed
PyTorch's ``sum`` faster for that width (there is no symbolic: the nodes exist only once the
gradient graph is built).

>>> from ortmodule_exporter.aten.kernel_choice import row_sum_route
>>> row_sum_route(256) in ("engine", "torch")
True
"""

from __future__ import annotations

import torch

from ..executor import AtenFunction, register_aten_function
from .choice import CALIBRATION_NUMEL, _decide
from .helpers import _all_tensors
from .measuring import _engine_us, _randn, _seeded, _torch_us

ROW_SUM = "_ortmodule_row_sum"


def _row_sum(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The sum over the first ``int(overload)`` axes (a built-graph pass writes these nodes:
    ``passes/row_sums.py``); they are gradient nodes, with no gradient of their own."""
    (x,) = inputs
    assert x is not None
    return [x.sum(tuple(range(int(overload))))]


register_aten_function(ROW_SUM, AtenFunction(_row_sum, _all_tensors))


def measure_row_sum(rows: int, cols: int) -> tuple[float, float]:
    """Microseconds of summing a ``rows`` x ``cols`` float32 matrix over its rows (a bias's
    gradient): (engine, torch). Engine: ``ReduceSum`` over axis 0; PyTorch: ``sum(0)`` and one
    ATen node."""
    from onnx import TensorProto, helper

    _seeded()
    x = _randn(rows, cols)
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)]
    feeds = {"x": x, "axes": torch.tensor([0])}
    engine_us = _engine_us("row_sum", nodes, feeds, ["y"], {"axes": TensorProto.INT64})
    return engine_us, _torch_us(lambda: _row_sum("1", [x]), aten_nodes=1, engine_us=engine_us)


def row_sum_route(cols: int) -> str:
    """``"engine"`` or ``"torch"`` for a float32 sum over every axis but the last, ``cols``
    wide (a bias gradient the engine's gradient builder writes as ``ReduceSum``). Timed at
    :data:`CALIBRATION_NUMEL` elements: the row count is the batch's, unknown when the graph
    is built."""
    rows = max(1, CALIBRATION_NUMEL // max(cols, 1))
    return _decide(f"row_sum({cols})", "Float", rows, lambda: measure_row_sum(rows, cols))
