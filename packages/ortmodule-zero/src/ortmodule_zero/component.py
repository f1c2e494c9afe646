"""The ``ortmodule.components`` entry point of ortmodule-zero."""

from __future__ import annotations

import importlib.util

from ortmodule_exporter.components import Component, register_step_hook

from .stage3 import COMPONENT_NAME, OPTION, ZeroStage3Hook

__all__ = ["COMPONENT"]


def _register() -> None:
    # early, so parameters are gathered before any other hook looks at them
    register_step_hook("zero-stage3", ZeroStage3Hook(), order=10)


def _check() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install deepspeed); ZeRO stage 3 needs it"
    return None


COMPONENT = Component(
    name=COMPONENT_NAME,
    version="0.1.0",
    register=_register,
    options=(OPTION,),
    check=_check,
    summary="DeepSpeed ZeRO stage 3: partitioned parameters gathered for the engine",
)
