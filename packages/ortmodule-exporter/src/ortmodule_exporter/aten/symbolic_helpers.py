"""Helpers for the ATen symbolics: reading traced values (sizes, constants, ranks, devices,
whether they carry a gradient, which overload a traced call makes) and writing ATen nodes.

>>> from ortmodule_exporter.aten.symbolic_helpers import aten_node, traced_sizes
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import executor as aten_executor
from .executor import ATEN_DOMAIN
from .overloads import operator_name, resolve_overload

__all__ = [
    "aten_node",
    "const_node",
    "is_float_value",
    "maybe_float",
    "none_value",
    "traced_constant",
    "traced_device",
    "traced_overload",
    "traced_rank",
    "traced_requires_grad",
    "traced_sizes",
    "typed_like",
]


def const_node(g: Any, value: Any, dtype: torch.dtype | None = None) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def none_value(g: Any) -> Any:
    value = g.op("prim::Constant")
    value.setType(torch._C.NoneType.get())
    return value


def traced_sizes(value: Any) -> list[int | None] | None:
    """A traced tensor's sizes (None where unknown), or None when they are not known at all."""
    try:
        sizes = value.type().varyingSizes()
    except (AttributeError, RuntimeError):
        return None
    return list(sizes) if sizes is not None else None


def traced_constant(value: Any) -> torch.Tensor | None:
    """The tensor a traced value is a constant of (through Casts; an integer constant as a 0-d
    tensor), or None when it is computed."""
    node = value.node()
    while node.kind() == "onnx::Cast":
        node = node.inputsAt(0).node()
    if node.kind() not in ("onnx::Constant", "prim::Constant") or not node.hasAttribute("value"):
        return None
    kind = node.kindOf("value")
    if kind == "t":
        return node.t("value")
    if kind == "i":
        return torch.tensor(node.i("value"))
    return None


def traced_device(value: Any) -> Any:
    jit_type: Any = value.type()
    return jit_type.device() if hasattr(jit_type, "device") else None


def typed_like(
    value: Any, like: Any, sizes: Sequence[int | None] | None, dtype: torch.dtype | None = None
) -> Any:
    """Give an ATen node's output the dtype of ``like`` and ``sizes`` (None: a dynamic dim)."""
    base = like.type()
    if dtype is not None:
        base = base.with_dtype(dtype)
    value.setType(base.with_sizes(list(sizes)) if sizes is not None else base)
    return value


def aten_node(
    g: Any, operator: str, inputs: Sequence[Any], overload: str = "", outputs: int = 1
) -> Any:
    return g.op(
        f"{ATEN_DOMAIN}::ATen",
        *inputs,
        operator_s=operator,
        overload_name_s=overload,
        outputs=outputs,
    )


#: value types that carry a gradient
_FLOAT_SCALARS = frozenset({"Float", "Double", "Half", "BFloat16"})


def is_float_value(value: Any) -> bool:
    """A float tensor, or a list built from one (``torch.hstack([x, y])``)."""
    try:
        if value.type().scalarType() in _FLOAT_SCALARS:
            return True
    except (AttributeError, RuntimeError):
        pass
    producer = value.node()
    return producer.kind() in ("onnx::SequenceConstruct", "prim::ListConstruct") and any(
        is_float_value(v) for v in producer.inputs()
    )


def maybe_float(value: Any) -> bool:
    """Float, or of a type the exporter has not inferred (a path is kept until proven int)."""
    try:
        scalar = value.type().scalarType()
    except (AttributeError, RuntimeError):
        return True
    return scalar is None or scalar in _FLOAT_SCALARS


def traced_rank(value: Any) -> int | None:
    if value is None:
        return None
    try:
        rank = value.type().dim()
    except (AttributeError, RuntimeError):
        return None
    return int(rank) if rank is not None else None


def traced_overload(node: Any) -> str:
    """The overload a traced node calls, from the kinds of its inputs (aten_overloads: its
    schema may be an out= variant or the wrong one of index_fill.int_Tensor/int_Scalar); from
    its schema, or by argument count, when none fits."""
    resolved = resolve_overload(operator_name(node.kind()), node)
    if resolved is not None:
        return resolved
    try:
        schema = node.schema()
    except RuntimeError:
        schema = "(no schema)"
    if schema == "(no schema)":
        return _overload_for(operator_name(node.kind()), node)
    if not schema.startswith("aten::"):
        return ""
    return str(torch._C.parse_schema(schema).overload_name)


def _overload_for(name: str, node: Any) -> str:
    """The overload of a traced ``aten::name`` call (traced nodes carry no schema, and scalar
    arguments are tensors by now): the one the executor picks for that many arguments."""
    try:
        return aten_executor.aten_operator(name, "", node.inputsSize()).overload
    except aten_executor.UnsupportedAtenOperatorError:
        return ""


def traced_requires_grad(value: Any) -> bool:
    """Whether the traced value depends on something that requires grad (unknown: True)."""
    value_type = value.type()
    requires = getattr(value_type, "requires_grad", None)
    if requires is None:
        return True
    found = requires()
    return True if found is None else bool(found)
