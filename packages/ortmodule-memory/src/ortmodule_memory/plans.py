"""Recompute plans: the engine's plan strings, the optimization levels, the JSON plan file.

A plan names one cluster of recomputable subgraphs the engine found, as
``"<pattern>:<type>:<count>"``: ``"Gelu+:1:-1"`` recomputes every occurrence of the subgraph
``Gelu`` (type 1, a full recompute), ``"Cast+:2:3"`` the first three occurrences of a
compromised recompute (type 2: recompute part of the subgraph, stash a smaller tensor).

>>> from ortmodule_memory.plans import MemoryOptLevel, Plan, select_plans
>>> Plan.parse("BiasGelu+:1:-1")
Plan(pattern='BiasGelu+', opt_type=1, count=-1)
>>> select_plans(["BiasGelu+:1:-1", "Cast+:2:-1"], MemoryOptLevel.LAYERWISE)
['BiasGelu+:1:-1']
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MemoryOptLevel",
    "PlanError",
    "Plan",
    "read_plan_file",
    "select_plans",
    "write_plan_file",
]

#: the engine's probe setting: level 1 (basic recomputable ops), layer boundaries on, so that no
#: subgraph crosses a transformer layer (the layer-wise levels need this)
LAYER_BOUNDARY_PROBE = "1:1"
#: probe without layer boundaries: what level 0 uses, so user plans match the engine's default
DEFAULT_PROBE = "1:0"


class PlanError(ValueError):
    """A recompute plan or plan file is malformed; the message names it and the expected form."""


class MemoryOptLevel(enum.IntEnum):
    """``ORTMODULE_MEMORY_OPT_LEVEL``."""

    #: only the plans of ``ORTMODULE_MEMORY_OPT_CONFIG`` (none when it is unset)
    USER_SPECIFIED = 0
    #: every detected type-1 plan inside transformer layers: per-layer gradient checkpointing
    LAYERWISE = 1
    #: level 1 plus the compromised (type 2) plans
    LAYERWISE_WITH_COMPROMISE = 2


@dataclass(frozen=True)
class Plan:
    """One plan string of the engine: subgraph pattern, optimization type, occurrences (-1: all)."""

    pattern: str
    opt_type: int
    count: int

    @classmethod
    def parse(cls, text: str, where: str = "plan") -> Plan:
        parts = text.strip().rsplit(":", 2)
        if len(parts) != 3 or not parts[0]:
            raise PlanError(
                f"{where} {text!r} is not a recompute plan; write '<pattern>:<type>:<count>', "
                "for example 'Gelu+:1:-1' (recompute every Gelu subgraph)"
            )
        pattern, opt_type, count = parts
        try:
            t, n = int(opt_type), int(count)
        except ValueError:
            raise PlanError(
                f"{where} {text!r}: type and count must be integers, as in 'Gelu+:1:-1'"
            ) from None
        if t not in (1, 2):
            raise PlanError(
                f"{where} {text!r}: type {t} is unknown; 1 is a full recompute, 2 a compromised one"
            )
        if n == 0 or n < -1:
            raise PlanError(
                f"{where} {text!r}: count {n} must be -1 (every occurrence) or a positive number"
            )
        return cls(pattern, t, n)

    def __str__(self) -> str:
        return f"{self.pattern}:{self.opt_type}:{self.count}"


def _plans_in(cluster_id: str) -> list[str]:
    """A cluster id is one plan or several joined with ``,`` (options that go together)."""
    return [p for p in cluster_id.split(",") if p.strip()]


def select_plans(cluster_ids: Iterable[str], level: MemoryOptLevel | int) -> list[str]:
    """The plans a level applies, from the engine's detected cluster ids, in their order.

    Level 1 keeps the type-1 plans, level 2 type 1 and type 2; level 0 applies nothing detected
    (its plans come from the user's file).
    """
    level = MemoryOptLevel(level)
    if level == MemoryOptLevel.USER_SPECIFIED:
        return []
    allowed = {1} if level == MemoryOptLevel.LAYERWISE else {1, 2}
    chosen: list[str] = []
    for cluster in cluster_ids:
        kept = [p for p in _plans_in(cluster) if Plan.parse(p, "detected plan").opt_type in allowed]
        if kept:
            chosen.append(",".join(kept))
    return chosen


def read_plan_file(path: str | os.PathLike[str]) -> list[str]:
    """The plans of a ``ORTMODULE_MEMORY_OPT_CONFIG`` file: a JSON list of plan strings.

    Each entry is validated; an entry may join several plans with ``,`` as the engine's table
    prints them.
    """
    where = f"ORTMODULE_MEMORY_OPT_CONFIG file {os.fspath(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise PlanError(f"{where} cannot be read: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(
            f'{where} is not JSON ({err}); write a list of plans, e.g. ["Gelu+:1:-1"]'
        ) from None
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        raise PlanError(f'{where} must hold a JSON list of strings, e.g. ["Gelu+:1:-1"]')
    for item in data:
        for plan in _plans_in(item):
            Plan.parse(plan, f"{where}: entry")
    return [item.strip() for item in data if item.strip()]


def write_plan_file(plans: Sequence[str], folder: str | os.PathLike[str]) -> str:
    """Write ``plans`` as the JSON list the engine reads; returns the file's path.

    The engine takes plans only as a file path (an inline string fails to parse), and it reads
    the file while the session is created.
    """
    os.makedirs(folder, exist_ok=True)
    body = json.dumps(list(plans))
    # one file per distinct plan list: sessions of several models never overwrite each other's
    name = f"recompute_plans_{hashlib.sha1(body.encode()).hexdigest()[:12]}.json"
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(body)
    return path
