"""Memory optimization for ORTModule: layer-wise recompute, the opportunity table, memory lines.

Installed, it plugs into the runtime through the ``ortmodule.components`` entry point; nothing
needs importing. From Python::

    from ortmodule_memory import memory_report
    report = memory_report(model)  # after a training step
    print(report.format())
"""

from __future__ import annotations

from .inspector import memory_report
from .opportunities import MemoryReport, Opportunity, evaluate_saving
from .plans import MemoryOptLevel, Plan, PlanError, read_plan_file, select_plans

__all__ = [
    "MemoryOptLevel",
    "MemoryReport",
    "Opportunity",
    "Plan",
    "PlanError",
    "evaluate_saving",
    "memory_report",
    "read_plan_file",
    "select_plans",
]
