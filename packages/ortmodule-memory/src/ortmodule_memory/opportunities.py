"""The engine's recompute opportunities as data: pattern, frequency, saving in bytes.

``TrainingAgent.get_serialized_ortmodule_memory_stat(plan_file, probe, return_table)`` returns
the engine's text table and a map ``cluster id -> (symbolic saving, frequency)``. The saving is
an arithmetic expression over the graph's symbolic dims (``input.input_ids_dim0`` ...);
:func:`evaluate_saving` turns it into bytes for the current batch.

>>> evaluate_saving("((a)*(b)*(4)) * 4 * 1.000000", {"a": 2, "b": 8})
256
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .plans import Plan

__all__ = [
    "MemoryReport",
    "Opportunity",
    "dims_of_batch",
    "evaluate_saving",
    "format_bytes",
    "opportunities_from_stat",
]

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate_saving(expression: str, dims: Mapping[str, int]) -> int | None:
    """Bytes an engine saving expression stands for, or ``None`` when a dim has no value.

    Only numbers, dim names and ``+ - * /`` are accepted (the expression comes from the engine,
    but it is parsed, never evaluated as Python). Dim names may contain dots, so they are
    replaced by placeholders first.
    """
    names = sorted(dims, key=len, reverse=True)
    text = expression
    values: dict[str, float] = {}
    for i, name in enumerate(names):
        if name in text:
            placeholder = f"_d{i}_"
            text = text.replace(name, placeholder)
            values[placeholder] = float(dims[name])
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None

    def walk(node: ast.AST) -> float | None:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.Name):
            return values.get(node.id)  # unknown dims ("unknown", "empty_dim_param3") -> None
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if left is None or right is None:
                return None
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = walk(node.operand)
            return None if inner is None else -inner
        return None

    result = walk(tree)
    return None if result is None else int(round(result))


def dims_of_batch(
    model_inputs: Sequence[tuple[str, Sequence[Any]]],
    input_shapes: Mapping[str, Sequence[int]],
) -> dict[str, int]:
    """Symbolic dim name -> its value for this batch, from the graph inputs' declared shapes.

    ``model_inputs`` holds ``(input name, dims)`` where each dim is a name (``str``) or a number.
    """
    dims: dict[str, int] = {}
    for name, declared in model_inputs:
        shape = input_shapes.get(name)
        if shape is None or len(shape) != len(declared):
            continue
        for dim, value in zip(declared, shape, strict=True):
            if isinstance(dim, str) and dim:
                dims[dim] = int(value)
    return dims


@dataclass(frozen=True)
class Opportunity:
    """One cluster of recomputable subgraphs the engine found."""

    #: the engine's plan string(s) for it, e.g. ``"Gelu+:1:-1"``
    cluster_id: str
    #: how many times the subgraph occurs in the graph
    frequency: int
    #: the engine's saving expression over symbolic dims
    symbolic_saving: str
    #: bytes saved for the batch that built the graph; ``None`` when some dim is unnamed
    saving_bytes: int | None

    @property
    def plans(self) -> list[Plan]:
        return [Plan.parse(p, "detected plan") for p in self.cluster_id.split(",") if p]

    @property
    def pattern(self) -> str:
        return "; ".join(p.pattern for p in self.plans)

    @property
    def opt_type(self) -> int:
        return min(p.opt_type for p in self.plans)


@dataclass(frozen=True)
class MemoryReport:
    """What the memory optimizer found and did for one training graph."""

    level: int
    probe: str
    opportunities: tuple[Opportunity, ...]
    #: plan strings handed to the engine (empty: recompute off)
    applied: tuple[str, ...] = ()
    #: the JSON plan file handed to the engine, if any
    plan_file: str | None = None
    #: the engine's own text table (with the status of each plan)
    table: str = ""
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def recompute_on(self) -> bool:
        return bool(self.applied)

    def saving_bytes(self, applied_only: bool = True) -> int | None:
        """Total bytes saved (applied plans, or every opportunity); ``None`` if any is unknown."""
        chosen = {p for a in self.applied for p in a.split(",")}
        total = 0
        for o in self.opportunities:
            if applied_only and not any(p in chosen for p in o.cluster_id.split(",")):
                continue
            if o.saving_bytes is None:
                return None
            total += o.saving_bytes
        return total

    def format(self) -> str:
        """The opportunity table as text, one row per plan, largest saving first."""
        rows = [("plan", "type", "freq", "saving", "applied")]
        chosen = {p for a in self.applied for p in a.split(",")}
        for o in self.opportunities:
            saving = "unknown" if o.saving_bytes is None else format_bytes(o.saving_bytes)
            on = "yes" if any(p in chosen for p in o.cluster_id.split(",")) else "no"
            rows.append((o.cluster_id, str(o.opt_type), str(o.frequency), saving, on))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
        shapes = ", ".join(f"{k}={list(v)}" for k, v in self.input_shapes.items())
        head = (
            f"memory optimizer: level {self.level}, probe {self.probe}, "
            f"{len(self.opportunities)} recompute opportunities for batch {shapes or '(no inputs)'}"
        )
        return "\n".join([head, *lines])


def format_bytes(count: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: bytes in the largest binary unit that keeps the number >= 1."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def opportunities_from_stat(
    savings: Mapping[str, tuple[str, int]], dims: Mapping[str, int]
) -> tuple[Opportunity, ...]:
    """The engine's ``cluster id -> (symbolic saving, frequency)`` map as :class:`Opportunity`
    rows, largest known saving first."""
    found = [
        Opportunity(cluster, int(freq), str(expr), evaluate_saving(str(expr), dims))
        for cluster, (expr, freq) in savings.items()
    ]
    found.sort(key=lambda o: (-(o.saving_bytes or 0), o.cluster_id))
    return tuple(found)
