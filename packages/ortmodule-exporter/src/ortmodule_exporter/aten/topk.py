"""``torch.topk`` as eager picks it: PyTorch chooses the indices, the engine gathers the values.

ONNX ``TopK`` puts the lower index first among equal values; PyTorch's kernels do not (on CPU,
``torch.topk(torch.full((4,), 0.5), 2)`` gives indices ``[2, 3]``). A Mixture-of-Experts router
with a zero-initialized gate (AFMoE) scores every expert the same, so the engine sent each token
to other experts than eager did and the very first loss differed (4.8314 against 4.8422).

The indices come from an ATen node that runs ``torch.topk`` (:data:`TOPK_INDICES`, with no
gradient: its inputs are stop-gradient edges) and the values are ``GatherElements`` of the input
at those indices, which is exactly ``topk``'s values and which the engine differentiates as
eager does (the gradient scattered back to the picked positions).
"""

from __future__ import annotations

from typing import Any

import torch

from ..symbolics.registry import register_symbolic
from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset11
from .executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from .gradients import register_stop_gradient_edges

__all__ = ["TOPK_INDICES", "parse_topk_overload", "topk_overload"]

TOPK_INDICES = "_ortmodule_topk_indices"


def topk_overload(k: int | None, dim: int, largest: bool, sorted: bool) -> str:
    """The node's overload name: its constant arguments (``k`` None: the node's second input)."""
    return f"{-1 if k is None else k},{dim},{int(largest)},{int(sorted)}"


def parse_topk_overload(overload: str) -> tuple[int | None, int, bool, bool]:
    k, dim, largest, sorted_ = (int(p) for p in overload.split(","))
    return (None if k < 0 else k), dim, bool(largest), bool(sorted_)


def _indices(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x = inputs[0]
    assert x is not None
    k, dim, largest, sorted_ = parse_topk_overload(overload)
    if k is None:
        assert inputs[1] is not None
        k = int(inputs[1])
    return [torch.topk(x, k, dim, largest=largest, sorted=sorted_).indices]


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


def _topk(g: Any, self: Any, k: Any, dim: Any, largest: Any, sorted: Any, out: Any = None) -> Any:

    constants = [sh._maybe_get_const(v, "i") for v in (dim, largest, sorted)]
    rank = sh._get_tensor_rank(self)
    if out is not None and not sh._is_none(out):
        return symbolic_opset11.topk(g, self, k, dim, largest, sorted, out)
    if rank is None or rank == 0 or not all(isinstance(c, int) for c in constants):
        # (a 0-d input has one element: no ties; GatherElements wants a dim)
        # a dim or flag computed at run time: the ONNX TopK (lower index first among ties)
        return symbolic_opset11.topk(g, self, k, dim, largest, sorted, out)
    axis, is_largest, is_sorted = constants
    k_value = sh._maybe_get_const(k, "i")
    inputs = [self]
    if not isinstance(k_value, int):
        k_value = None
        inputs.append(g.op("Cast", k, to_i=sh.cast_pytorch_to_onnx["Long"]))
    overload = topk_overload(k_value, axis, bool(is_largest), bool(is_sorted))
    # the engine keys stop-gradient edges by overload: this one's are registered as it is made
    register_stop_gradient_edges(TOPK_INDICES, overload, [0, 1])
    indices = g.op(
        f"{ATEN_DOMAIN}::ATen",
        *inputs,
        operator_s=TOPK_INDICES,
        overload_name_s=overload,
        outputs=1,
    )
    indices.setType(self.type().with_dtype(torch.int64).with_sizes([None] * rank))
    values = g.op("GatherElements", self, indices, axis_i=axis)
    values.setType(self.type().with_sizes([None] * rank))
    return values, indices


register_aten_function(TOPK_INDICES, AtenFunction(_indices, _all_tensors))
register_symbolic("aten::topk", _topk, 11)
