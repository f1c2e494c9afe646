"""Recompute through the engine's memory optimizer: which plans a session gets, and why.

The session contributor :func:`contribute` runs before each training session is created:

* level 0 with ``ORTMODULE_MEMORY_OPT_CONFIG``: the user's plans (validated) go to the engine;
* level 1 / 2: a probe session finds every recompute opportunity inside transformer layers
  (probe ``1:1``), :func:`~ortmodule_memory.plans.select_plans` keeps the type-1 plans (level 1)
  or type 1 and 2 (level 2), and those go to the engine;
* recompute on: the engine's memory-efficient execution order too, so a recomputed activation
  is produced right before the backward node that reads it instead of early in the backward.

The engine reads plans only from a JSON file (``optimization.memory_optimizer_config``); the
files live in one folder per process, removed at exit.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ortmodule_exporter.components import SessionContext, SessionContribution
from ortmodule_exporter.engine import SessionConfig, TrainingSession

from .engine_output import held_stdout
from .opportunities import MemoryReport, dims_of_batch, opportunities_from_stat
from .options import MEMORY_OPT_CONFIG, MEMORY_OPT_LEVEL
from .plans import (
    DEFAULT_PROBE,
    LAYER_BOUNDARY_PROBE,
    MemoryOptLevel,
    read_plan_file,
    select_plans,
    write_plan_file,
)

__all__ = [
    "CONFIG_ENTRY_PLANS",
    "CONFIG_ENTRY_PROBE",
    "RecomputeDecision",
    "contribute",
    "decide",
    "probe_report",
]

logger = logging.getLogger("ortmodule.memory")

CONFIG_ENTRY_PLANS = "optimization.memory_optimizer_config"
CONFIG_ENTRY_PROBE = "optimization.enable_memory_probe_recompute_config"

LEVEL = MEMORY_OPT_LEVEL.name
CONFIG = MEMORY_OPT_CONFIG.name

_FOLDER: list[str] = []
_LOCK = threading.Lock()


def _plan_folder() -> str:
    with _LOCK:
        if not _FOLDER:
            folder = tempfile.mkdtemp(prefix="ortmodule_memory_")
            atexit.register(shutil.rmtree, folder, True)
            _FOLDER.append(folder)
        return _FOLDER[0]


@dataclass(frozen=True)
class RecomputeDecision:
    """The plans a session gets; ``report`` is filled when a probe ran before the session."""

    level: MemoryOptLevel
    probe: str
    plans: tuple[str, ...]
    plan_file: str | None
    report: MemoryReport | None = None


def level_of(options: Mapping[str, Any]) -> MemoryOptLevel:
    value = options.get(LEVEL, 0)
    try:
        return MemoryOptLevel(int(value if value is not None else 0))
    except ValueError:
        raise ValueError(
            f"{LEVEL}={value!r} is not a memory optimization level; use 0 (plans from "
            f"{CONFIG}), 1 (layer-wise recompute) or 2 (layer-wise with compromised plans)"
        ) from None


def model_dims(ctx: SessionContext) -> dict[str, int]:
    """Symbolic dim name -> value for the batch that built this graph."""
    declared = []
    for vi in ctx.model.graph.input:
        dims: list[Any] = []
        for d in vi.type.tensor_type.shape.dim:
            dims.append(d.dim_param if d.HasField("dim_param") else d.dim_value)
        declared.append((vi.name, dims))
    return dims_of_batch(declared, ctx.input_shapes)


def probe_report(
    agent: Any,
    ctx: SessionContext,
    level: int,
    probe: str,
    plan_file: str | None,
    applied: tuple[str, ...],
) -> MemoryReport:
    """Ask the engine for its opportunity table on ``agent``'s graph."""
    engine_text: list[str] = []
    with held_stdout(engine_text):
        table, savings = agent.get_serialized_ortmodule_memory_stat(plan_file or "", probe, True)
    if engine_text and engine_text[0].strip():
        logger.debug("engine output while probing recompute opportunities:\n%s", engine_text[0])
    return MemoryReport(
        level=int(level),
        probe=probe,
        opportunities=opportunities_from_stat(savings, model_dims(ctx)),
        applied=applied,
        plan_file=plan_file,
        table=str(table),
        input_shapes={k: tuple(v) for k, v in ctx.input_shapes.items()},
    )


def _probe_session(ctx: SessionContext) -> TrainingSession:
    if ctx.built is None:
        raise RuntimeError(
            "ortmodule-memory: the runtime passed no built graph in the SessionContext, so the "
            "recompute plans cannot be probed; update ortmodule and ortmodule-exporter together"
        )
    config = SessionConfig(device=ctx.device, intra_op_threads=torch.get_num_threads())
    engine_text: list[str] = []
    with held_stdout(engine_text):
        return TrainingSession(ctx.built, config)


def decide(ctx: SessionContext) -> RecomputeDecision | None:
    """The recompute plans for this session, or ``None`` when recompute stays off."""
    if not ctx.training:
        return None
    level = level_of(ctx.options)
    if level == MemoryOptLevel.USER_SPECIFIED:
        path = ctx.options.get(CONFIG)
        if not path:
            return None
        plans = tuple(read_plan_file(path))
        if not plans:
            return None
        return RecomputeDecision(level, DEFAULT_PROBE, plans, str(path))
    probe = LAYER_BOUNDARY_PROBE
    session = _probe_session(ctx)
    found = probe_report(session.agent, ctx, level, probe, None, ())
    del session  # the probe's arena is released before the real session is created
    plans = tuple(select_plans((o.cluster_id for o in found.opportunities), level))
    if not plans:
        logger.info(
            "memory optimizer level %d: the engine found no layer-wise recompute plan in this "
            "graph; training runs without recompute",
            int(level),
        )
        return RecomputeDecision(level, probe, (), None, found)
    return RecomputeDecision(level, probe, plans, write_plan_file(plans, _plan_folder()), found)


_DECISIONS: dict[int, RecomputeDecision] = {}


def contribute(ctx: SessionContext) -> SessionContribution | None:
    """Session contributor: the plan file, the probe level and the memory-efficient order."""
    decision = decide(ctx)
    if decision is None:
        return None
    with _LOCK:
        # picked up by the step hook's on_session, which gets the same context object
        _DECISIONS[id(ctx)] = decision
    if not decision.plans or decision.plan_file is None:
        return None
    return SessionContribution(
        config_entries={
            CONFIG_ENTRY_PLANS: decision.plan_file,
            CONFIG_ENTRY_PROBE: decision.probe,
        },
        memory_efficient_order=True,
        # recompute trades time for memory; the engine's arena would keep a step's peak of
        # engine buffers for the session's life, so on CPU it allocates without one
        release_cpu_memory=True,
    )


def take_decision(ctx: SessionContext) -> RecomputeDecision | None:
    """The decision :func:`contribute` made for ``ctx`` (once)."""
    with _LOCK:
        return _DECISIONS.pop(id(ctx), None)
