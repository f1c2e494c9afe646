"""Decisions kept with the export cache, keyed by the machine that measured them.

A graph exported under ``auto`` has the routes this machine measured baked into it, so the
export cache keys such a graph by :func:`machine_fingerprint` (another CPU, thread count or
library version exports and measures again), and keeps the decisions in the entry as plain
JSON (:func:`decisions_to_json`) that a warm start takes back (:func:`decisions_from_json`)
for the passes that consult the kernel choice after the export.

>>> from ortmodule_exporter.aten.kernel_choice import decisions_from_json, decisions_to_json
>>> decisions_from_json(decisions_to_json())
0
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...engine_binding import import_onnxruntime
from .choice import _take_decisions, decisions
from .measuring import ATEN_NODE_US
from .modes import current_torch_threads


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine_key() -> dict[str, Any]:
    """What the measurements depend on: the CPU model, PyTorch's thread count (the engine's
    sessions get as many), the in-engine PyTorch thread count and the torch and ONNX Runtime
    versions."""
    return {
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "torch_threads_in_engine": current_torch_threads(),
        "torch": torch.__version__,
        "onnxruntime": str(getattr(import_onnxruntime(), "__version__", "?")),
        "aten_node_us": ATEN_NODE_US,
    }


def machine_fingerprint() -> str:
    """A SHA-256 of :func:`machine_key`: part of the export-cache key of ``auto`` graphs."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()


#: what a size key may hold once read back (ints, strings and nested tuples of them)
_MAX_DECISIONS = 10_000


def _key_to_json(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return {"tuple": [_key_to_json(v) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"kernel-choice key {value!r} is not plain data")


def _key_from_json(data: Any, depth: int = 0) -> Any:
    if depth > 8:
        raise ValueError("kernel-choice key nested too deeply")
    if isinstance(data, dict) and set(data) == {"tuple"} and isinstance(data["tuple"], list):
        return tuple(_key_from_json(v, depth + 1) for v in data["tuple"])
    if data is None or type(data) in (bool, int, float, str):
        return data
    raise ValueError(f"bad kernel-choice key {data!r}")


def _us_to_json(value: float) -> float | None:
    return None if math.isinf(value) else value  # JSON has no infinity


def decisions_to_json() -> list[list[Any]]:
    """Every decision of this process as plain JSON data (for the export cache)."""
    out = []
    for (op, dtype, size), (route, engine_us, torch_us) in decisions().items():
        try:
            out.append([op, dtype, _key_to_json(size), route, engine_us, _us_to_json(torch_us)])
        except TypeError:
            continue  # a size that is not plain data stays in this process only
    return out


def decisions_from_json(data: Any) -> int:
    """Take decisions that :func:`decisions_to_json` wrote (in an export-cache entry of this
    machine) that this process has not made itself; how many were taken. ``ValueError`` when
    ``data`` is not such a list (nothing is taken then)."""
    if not isinstance(data, list) or len(data) > _MAX_DECISIONS:
        raise ValueError("kernel-choice decisions must be a list")
    found: dict[tuple[str, str, Any], tuple[str, float, float]] = {}
    for item in data:
        if not isinstance(item, list) or len(item) != 6:
            raise ValueError("bad kernel-choice decision")
        op, dtype, size, route, engine_us, torch_us = item
        if (
            not isinstance(op, str)
            or not isinstance(dtype, str)
            or route not in ("engine", "torch")
        ):
            raise ValueError("bad kernel-choice decision")
        if type(engine_us) not in (int, float) or (
            torch_us is not None and type(torch_us) not in (int, float)
        ):
            raise ValueError("bad kernel-choice timing")
        found[(op, dtype, _key_from_json(size))] = (
            route,
            float(engine_us),
            math.inf if torch_us is None else float(torch_us),
        )
    return _take_decisions(found)
