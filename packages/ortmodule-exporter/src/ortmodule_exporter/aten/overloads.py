"""Which overload of an ``aten::`` operator a traced call made, from its argument values.

A traced node carries no reliable schema: ``node.schema()`` is the first schema with as many
arguments, which may be an ``out=`` variant (``round.out`` for ``round(x, decimals=3)``) or the
wrong one of two (``index_fill.int_Scalar`` for a tensor value, ``trapz.dx`` for a tensor
``x``). Routed to ATen with that overload the call fails, or silently drops a gradient (the
tensor read as a Scalar). Here each candidate is scored on how its argument kinds fit the
traced inputs: a constant fits a scalar argument (int, float, Scalar, lists), a computed
tensor fits a Tensor argument and never a scalar one when it may need a gradient.

>>> resolve_overload("quantile", node)  # q=0.5 traced as a constant
'scalar'
"""

from __future__ import annotations

from typing import Any

import torch

from .executor import _kind

__all__ = ["operator_name", "resolve_fallback_overloads", "resolve_overload"]

_CONSTANT_KINDS = frozenset({"prim::Constant", "onnx::Constant", "prim::NumToTensor"})
_SCALAR_KINDS = frozenset({"int", "float", "bool", "Scalar", "ScalarType", "int[]", "float[]"})


def operator_name(kind: str) -> str:
    """The functional ATen operator a traced node kind calls: ``aten::add_`` -> ``add``, and
    a Python operator keeps its name (``aten::__or__`` -> ``__or__``, which no in-place
    suffix ends)."""
    name = kind.split("::", 1)[1]
    if name.startswith("__") and name.endswith("__"):
        return name
    return name.rstrip("_")


def _constant_rank(value: Any) -> int | None:
    """The rank of a constant input (0 for a number, 1 for a list), or None when it is
    computed."""
    if value.type().kind() == "ListType":
        return 1
    if value.node().kind() not in _CONSTANT_KINDS:
        return None
    try:
        rank = value.type().dim()
    except (AttributeError, RuntimeError):
        return 0
    return int(rank or 0)


def _writes(schema: Any) -> bool:
    """An out= (or in-place) overload: it writes one of its arguments."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _score(schema: Any, inputs: list[Any]) -> int | None:
    score = 0
    for arg, value in zip(schema.arguments, inputs, strict=True):
        kind, optional = _kind(arg.type)
        if value.type().kind() == "NoneType":
            if not optional:  # None fits an Optional argument only (gradient.scalarint)
                return None
            continue
        rank = _constant_rank(value)
        if kind == "Tensor":
            score += 0 if rank is not None and rank == 0 else 2
        elif kind in _SCALAR_KINDS:
            # a computed tensor read as a scalar loses its gradient; a list is a 1-d constant
            if rank is None or rank != (1 if kind.endswith("[]") else 0):
                return None
            score += 1
        elif kind == "Tensor[]":
            score += 1
    return score


def resolve_overload(name: str, node: Any) -> str | None:
    """The overload name of ``aten::name`` that fits ``node``'s inputs best ("" for default),
    or None when no non-``out`` overload takes that many arguments."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    inputs = list(node.inputs())
    best: tuple[int, int, str] | None = None
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if len(schema.arguments) != len(inputs) or _writes(schema):
            continue
        score = _score(schema, inputs)
        if score is None:
            continue
        # ties: default first, then Tensor, then the name (aten_operator's order)
        rank = 0 if overload == "default" else 1 if overload == "Tensor" else 2
        key = (-score, rank, overload)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    return "" if best[2] == "default" else best[2]


def resolve_fallback_overloads(node: Any, emitted: list[Any]) -> None:
    """Name the overload on the ATen nodes torch's exporter wrote for ``node`` (an operator
    without symbolic): it writes the traced schema's, or none. It names the operator as if the
    kind's last "_" marked an in-place call, ``__or_`` for ``aten::__or__`` (an int mask's
    ``|``), which PyTorch has not: such a node gets the operator's own name."""
    kind = node.kind().split("::", 1)[1]
    written = kind[:-1] if kind.endswith("_") else kind
    name = operator_name(node.kind())
    for n in emitted:
        if not n.kind().endswith("::ATen") or not n.hasAttribute("operator"):
            continue
        if n.s("operator") not in (name, written):
            continue
        n.s_("operator", name)
        resolved = resolve_overload(name, node)
        if resolved is not None:
            n.s_("overload_name", resolved)
