"""The runtime step hook of the memory component: the opportunity table and per-step memory lines.

After a training session is created, the engine's opportunity table for the graph is logged at
INFO (rank 0) and kept as data: :func:`memory_report` returns it for a model.

>>> report = memory_report(model)  # doctest: +SKIP
>>> [(o.cluster_id, o.frequency, o.saving_bytes) for o in report.opportunities]  # doctest: +SKIP
[('FusedMatMul+Add+:1:-1', 4, 1048576), ...]
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ortmodule_exporter.components import SessionInfo, StepContext, StepHook

from .memory_stats import format_sample, memory_sample
from .opportunities import MemoryReport, format_bytes
from .options import PRINT_MEMORY_STATS
from .plans import LAYER_BOUNDARY_PROBE
from .recompute import LEVEL, level_of, probe_report, take_decision

__all__ = ["MemoryHook", "memory_report"]

logger = logging.getLogger("ortmodule.memory")

PRINT_STATS = PRINT_MEMORY_STATS.name
LOG_LEVEL = "ORTMODULE_LOG_LEVEL"
_INFO = 2  # ortmodule's LogLevel.INFO; the options carry the runtime's IntEnum

_REPORTS: weakref.WeakKeyDictionary[torch.nn.Module, MemoryReport] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def memory_report(model: torch.nn.Module) -> MemoryReport | None:
    """The memory optimizer's report for the latest training graph of ``model``.

    ``model`` may be the ORTModule, the module it wraps, or a DDP wrapper around either; ``None``
    until a training step has built a graph (or when the table was not asked for: recompute off
    and a log level above INFO).
    """
    seen = 0
    current: Any = model
    while current is not None and seen < 4:
        with _LOCK:
            found = _REPORTS.get(current)
        if found is not None:
            return found
        current = getattr(current, "module", None)
        seen += 1
    return None


def _wants_table(options: Any) -> bool:
    level = options.get(LOG_LEVEL)
    return level is not None and int(level) <= _INFO


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class MemoryHook(StepHook):
    """Opportunity table after session creation; memory lines around forward and backward."""

    def __init__(self) -> None:
        self._steps: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()

    # -- the opportunity table -----------------------------------------------------------------
    def on_session(self, ctx: StepContext, info: SessionInfo) -> None:
        decision = take_decision(info.context)
        if not info.context.training:
            return
        agent = getattr(info.session, "agent", None)
        if decision is None and not _wants_table(ctx.options):
            return
        if agent is None:
            return
        level = level_of(ctx.options) if decision is None else decision.level
        if decision is not None and decision.plans:
            report = probe_report(
                agent, info.context, level, decision.probe, decision.plan_file, decision.plans
            )
            if decision.report is not None:
                # the probe saw every opportunity; the applied session's table only its own
                report = MemoryReport(
                    level=report.level,
                    probe=report.probe,
                    opportunities=decision.report.opportunities,
                    applied=report.applied,
                    plan_file=report.plan_file,
                    table=report.table,
                    input_shapes=report.input_shapes,
                )
        elif decision is not None and decision.report is not None:
            report = decision.report
        else:
            # recompute off: the layer-wise probe shows what level 1 would do
            report = probe_report(agent, info.context, level, LAYER_BOUNDARY_PROBE, None, ())
        with _LOCK:
            _REPORTS[ctx.module] = report
        self._log(report)

    def _log(self, report: MemoryReport) -> None:
        lines = [report.format()]
        if report.applied:
            total = report.saving_bytes()
            shown = "unknown" if total is None else format_bytes(total)
            lines.append(
                f"recompute on: {len(report.applied)} plans applied, saving {shown} of stashed "
                f"activations for this batch: {', '.join(report.applied)}"
            )
        elif report.opportunities:
            total = report.saving_bytes(applied_only=False)
            shown = "" if total is None else f" (up to {format_bytes(total)} for this batch)"
            lines.append(
                f"recompute is off; {LEVEL}=1 would recompute every layer-wise subgraph above"
                f"{shown} at some extra compute, 2 adds the compromised plans; or list chosen "
                "plans in a JSON file named by ORTMODULE_MEMORY_OPT_CONFIG"
            )
        logger.info("%s", "\n".join(lines))

    # -- per-step memory lines ------------------------------------------------------------------
    def _print(self, ctx: StepContext, phase: str) -> None:
        if not ctx.options.get(PRINT_STATS):
            return
        device = _device_of(ctx.module)
        if phase == "pre_forward" and ctx.module not in self._steps:
            self._steps[ctx.module] = 0
            if device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats(device)
        step = self._steps.get(ctx.module, 0)
        rank, world = _rank_world()
        logger.warning("%s", format_sample(step, phase, memory_sample(device), rank, world))

    def applies_to(self, ctx: StepContext) -> bool:
        # the per-step phases only print memory lines
        return bool(ctx.options.get(PRINT_STATS))

    def pre_forward(self, ctx: StepContext) -> None:
        self._print(ctx, "pre_forward")

    def post_forward(self, ctx: StepContext, outputs: Any) -> None:
        self._print(ctx, "post_forward")

    def pre_backward(self, ctx: StepContext) -> None:
        self._print(ctx, "pre_backward")

    def post_backward(self, ctx: StepContext) -> None:
        self._print(ctx, "post_backward")
        if ctx.module in self._steps:
            self._steps[ctx.module] += 1


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
