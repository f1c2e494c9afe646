"""Train PyTorch models through ONNX Runtime's training engine: ``model = ORTModule(model)``.

>>> import torch
>>> from ortmodule import ORTModule
>>> model = ORTModule(torch.nn.Linear(4, 2))
>>> loss = model(torch.randn(8, 4)).pow(2).mean()
>>> loss.backward()
"""

import sys as _sys

from .engine_check import check_engine

# `ortmodule doctor` must run (and report the problem) even when the engine is missing.
if _sys.argv[1:2] != ["doctor"]:
    check_engine()

# ruff: noqa: E402 - the engine check must run before anything imports the engine
from ortmodule_exporter import EngineBuildError, ExportError, ORTModuleError, register_symbolic

from .debug_options import DebugOptions, LogLevel
from .fallback import InitializationError
from .options import FallbackPolicy, RuntimeOptions
from .ortmodule import ORTModule

__version__ = "0.1.0"

__all__ = [
    "DebugOptions",
    "EngineBuildError",
    "ExportError",
    "FallbackPolicy",
    "InitializationError",
    "LogLevel",
    "ORTModule",
    "ORTModuleError",
    "RuntimeOptions",
    "register_symbolic",
]
