"""What the operator families share: the tensor predicate of their ATen functions, the overload
of one of their ATen nodes in a graph, and their symbolics' reading of a traced value's dtype,
int constants and per-dim settings.

>>> _per_dim([2], 2, 1)
[2, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
import torch

from ...onnx_graph import attribute
from ..executor import ATEN_DOMAIN


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


def _aten_overload(node: onnx.NodeProto, operator: str) -> str | None:
    """The overload name of ``node`` where it is an ATen node running ``operator``; else None."""
    if (
        node.op_type != "ATen"
        or node.domain != ATEN_DOMAIN
        or attribute(node, "operator", "") != operator
    ):
        return None
    return str(attribute(node, "overload_name", ""))


def _dtype(value: Any) -> str | None:
    jit_type = value.type()
    return jit_type.scalarType() if hasattr(jit_type, "scalarType") else None


def _ints_const(g: Any, values: Sequence[int]) -> Any:
    return g.op("Constant", value_t=torch.tensor(list(values), dtype=torch.int64))


def _per_dim(values: Any, n: int, fill: int) -> list[int]:
    values = [int(v) for v in values] if values is not None else []
    if not values:
        return [fill] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{values} does not give {n} dims")
    return values
