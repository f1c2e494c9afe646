"""The ``ortmodule.components`` entry point of ortmodule-zero."""

from __future__ import annotations

import importlib.util

from ortmodule_exporter.components import (
    Component,
    register_session_contributor,
    register_step_hook,
    register_untracked_attributes,
)

from .options import OPTIONS
from .partitioned_optimizer import ZeroOptimizerSessions
from .stage3 import COMPONENT_NAME, ZeroStage3Hook

__all__ = ["COMPONENT", "DEEPSPEED_MODULE_ATTRIBUTES"]

#: prefixes of the attributes DeepSpeed's ZeRO stage 3 writes on the modules it manages
DEEPSPEED_MODULE_ATTRIBUTES = (
    "ds_",
    "_ds_",
    "pre_bwd_fn",
    "post_bwd_fn",
    "applied_pre_backward_ref_cnt",
    "_external_params",
    "_original_parameters",
    "all_parameters",
    "wall_clock_breakdown",
)


def _register() -> None:
    # early, so parameters are gathered before any other hook looks at them
    hook = ZeroStage3Hook()
    register_step_hook("zero-stage3", hook, order=10)
    # sessions built inside a stage-3 step allocate without the CPU engine's arena
    register_session_contributor("zero-stage3", hook.session_contribution)
    # and so do sessions of a module whose parameters a stage 1/2 optimizer holds
    stages12 = ZeroOptimizerSessions()
    register_step_hook("zero-stages12", stages12, order=11)
    register_session_contributor("zero-stages12", stages12.session_contribution)
    # DeepSpeed keeps per-step bookkeeping on the module (ds_grads_remaining, its backward
    # Functions, reference counts): writes of those through the ORTModule wrapper are no change
    # of the model's flags (the names deepspeed/runtime/zero assigns on modules, 0.19)
    register_untracked_attributes(*DEEPSPEED_MODULE_ATTRIBUTES)


def _check() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install deepspeed); ZeRO stage 3 needs it"
    return None


COMPONENT = Component(
    name=COMPONENT_NAME,
    version="0.1.0",
    register=_register,
    options=OPTIONS,
    check=_check,
    summary="DeepSpeed ZeRO: stage 3's partitioned parameters gathered for the engine; "
    "sessions without the CPU arena under stages 1-3",
)
