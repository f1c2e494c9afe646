"""``ORTMODULE_TRITON_DEBUG=1``: every fused subgraph, as found and as compiled, and its source.

Files go to ``triton_debug/`` under the working directory, named by the kernel:
``<kernel>.original.onnx`` (the nodes cut out of the graph), ``<kernel>.processed.onnx`` (the
model the code generator compiled: constants embedded, for a gradient kernel the recomputed
forward and the gradient ops) and ``<kernel>.py`` (the generated Triton source).
"""

from __future__ import annotations

import threading
from pathlib import Path

import onnx

from .codegen import KernelPlan

__all__ = ["DEBUG_DIR", "dump", "set_debug"]

DEBUG_DIR = "triton_debug"
_ENABLED = [False]
_LOCK = threading.Lock()


def set_debug(enabled: bool) -> None:
    _ENABLED[0] = enabled


def dump(plan: KernelPlan, original: onnx.ModelProto, processed: onnx.ModelProto) -> Path | None:
    """Write the three files when debugging is on; returns the folder or ``None``."""
    if not _ENABLED[0]:
        return None
    folder = Path.cwd() / DEBUG_DIR
    with _LOCK:
        folder.mkdir(exist_ok=True)
        onnx.save(original, str(folder / f"{plan.fn_name}.original.onnx"))
        onnx.save(processed, str(folder / f"{plan.fn_name}.processed.onnx"))
        (folder / f"{plan.fn_name}.py").write_text(plan.source)
    return folder
