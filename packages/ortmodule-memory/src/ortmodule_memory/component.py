"""The ``ortmodule.components`` entry point of ortmodule-memory."""

from __future__ import annotations

from ortmodule_exporter import register_post_export_pass
from ortmodule_exporter.components import (
    Component,
    register_session_contributor,
    register_step_hook,
)

from .grad_management import ParamSource, pull_parameters
from .inspector import MemoryHook
from .options import OPTIONS
from .recompute import contribute

__all__ = ["COMPONENT", "OPTIONS"]

#: after the BatchNorm statistics (10) and PythonOp shapes (20) passes
GRAD_MGMT_ORDER = 50


def _register() -> None:
    register_post_export_pass("memory.grad_management", pull_parameters, order=GRAD_MGMT_ORDER)
    # first: the parameters' module must be known before the export a forward may trigger
    register_step_hook("memory.param_source", ParamSource(), order=0)
    register_session_contributor("memory", contribute)
    register_step_hook("memory", MemoryHook())


COMPONENT = Component(
    name="ortmodule-memory",
    version="0.1.0",
    register=_register,
    options=OPTIONS,
    summary="recompute (ORTMODULE_MEMORY_OPT_LEVEL 0/1/2), opportunity table, memory statistics",
)
