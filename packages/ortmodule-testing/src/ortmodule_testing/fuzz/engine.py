"""The engine under test: ORTModule with fallback disabled, and what counts as a clear refusal.

Importing this module imports ortmodule (the generator and the runner do not).
"""

from __future__ import annotations

import os

from torch import nn

from ortmodule import ORTModule, ORTModuleError
from ortmodule.bundle import MissingComponentError
from ortmodule.execution import UnsupportedDataError, UnsupportedDeviceError

__all__ = ["REFUSALS", "ortmodule_engine"]

#: errors ORTModule raises on purpose, each naming the thing and what to do
REFUSALS: tuple[type[BaseException], ...] = (
    ORTModuleError,
    UnsupportedDataError,
    UnsupportedDeviceError,
    MissingComponentError,
)


def ortmodule_engine(module: nn.Module) -> nn.Module:
    """``ORTModule(module)``; fallback must be disabled, else a fallback compares eager to eager."""
    if os.environ.get("ORTMODULE_FALLBACK_POLICY") != "FALLBACK_DISABLE":
        raise RuntimeError(
            "the fuzzer needs ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE (a fallback to PyTorch "
            "would compare eager with eager); set it before running programs"
        )
    return ORTModule(module)
