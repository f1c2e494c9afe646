"""Importing Triton in the mode this process can use.

Triton decides once, when it is first imported, whether kernels are compiled for a GPU or run by
its interpreter (``TRITON_INTERPRET=1``; its reductions are bound at import). A process without
CUDA can only interpret, so when this package is the first to import Triton there, it turns the
interpreter on. Importing :mod:`ortmodule_triton` itself never imports Triton.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

import torch

__all__ = ["check_device", "interpreting", "load_triton"]

logger = logging.getLogger("ortmodule.triton")


def load_triton() -> ModuleType:
    """``import triton``, with the interpreter on where no CUDA device exists."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        if os.environ.setdefault("TRITON_INTERPRET", "1") == "1":
            logger.debug("no CUDA device: Triton kernels run under TRITON_INTERPRET=1")
    import triton

    module: ModuleType = triton
    return module


def interpreting() -> bool:
    return bool(load_triton().knobs.runtime.interpret)


def check_device(device: object, what: str) -> None:
    """Raise a clear error when ``device`` does not match the mode Triton was imported in."""
    kind = getattr(device, "type", str(device))
    if kind == "cpu" and not interpreting():
        raise RuntimeError(
            f"{what}: CPU tensors run only under Triton's interpreter, and triton was imported "
            "without it. Set TRITON_INTERPRET=1 before anything imports triton (CPU runs are for "
            "verification: exact but far slower than torch)."
        )
    if kind == "cuda" and interpreting():
        raise RuntimeError(
            f"{what}: triton was imported with TRITON_INTERPRET=1, so it cannot compile for CUDA; "
            "unset TRITON_INTERPRET to run on the GPU."
        )
    if kind not in ("cpu", "cuda"):
        raise RuntimeError(
            f"{what}: Triton kernels run on CUDA or (interpreted) CPU tensors, not {kind}"
        )
