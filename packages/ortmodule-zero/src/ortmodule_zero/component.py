"""The ``ortmodule.components`` entry point of ortmodule-zero."""

from __future__ import annotations

import importlib.util

from ortmodule_exporter.components import (
    Component,
    register_step_hook,
    register_untracked_attributes,
)

from .stage3 import COMPONENT_NAME, OPTION, ZeroStage3Hook

__all__ = ["COMPONENT"]


def _register() -> None:
    # early, so parameters are gathered before any other hook looks at them
    register_step_hook("zero-stage3", ZeroStage3Hook(), order=10)
    # DeepSpeed keeps per-step bookkeeping on the module (ds_grads_remaining, ds_id, ...): writes
    # of those through the ORTModule wrapper must not count as a change of the model's flags
    register_untracked_attributes("ds_", "_ds_")


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
