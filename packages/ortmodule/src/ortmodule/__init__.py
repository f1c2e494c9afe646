"""Train PyTorch models through ONNX Runtime's training engine: ``model = ORTModule(model)``.

>>> import torch
>>> from ortmodule import ORTModule
>>> model = ORTModule(torch.nn.Linear(4, 2))
>>> loss = model(torch.randn(8, 4)).pow(2).mean()
>>> loss.backward()
"""

import sys as _sys
from typing import TYPE_CHECKING

from .engine_check import check_engine

# `ortmodule doctor` must run (and report the problem) even when the engine is missing.
if _sys.argv[1:2] != ["doctor"]:
    check_engine()

# ruff: noqa: E402 - the engine check must run before anything imports the engine
from ortmodule_exporter import EngineBuildError, ExportError, ORTModuleError, register_symbolic

from .bundle import MissingComponentError, find_export
from .debug_options import DebugOptions, LogLevel
from .fallback import InitializationError
from .options import FallbackPolicy, RuntimeOptions
from .ortmodule import ORTModule

if TYPE_CHECKING:  # the names __getattr__ resolves, for type checkers
    from ortmodule_optim import FP16_Optimizer, FusedAdam
    from ortmodule_sampler import (
        LoadBalancingDistributedBatchSampler,
        LoadBalancingDistributedSampler,
    )

__version__ = "0.1.0"

__all__ = [
    "DebugOptions",
    "EngineBuildError",
    "ExportError",
    "FP16_Optimizer",
    "FallbackPolicy",
    "FusedAdam",
    "InitializationError",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "LogLevel",
    "MissingComponentError",
    "ORTModule",
    "ORTModuleError",
    "RuntimeOptions",
    "register_symbolic",
]


def __getattr__(name: str) -> object:
    # components' public names (their "ortmodule.exports" entry points), imported on first use:
    # one import path per class, and a missing component fails only the import that needs it,
    # naming the distribution to install
    value = find_export(name, promised=name in __all__)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
