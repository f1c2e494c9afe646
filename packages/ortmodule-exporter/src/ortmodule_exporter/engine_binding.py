"""The engine binding: import ONNX Runtime and hand out its C++ training API (``_C``).

A leaf module: it imports nothing of ours, so every part of the exporter can import it at
module level. onnxruntime itself is imported on first use, so importing the exporter does not
load the engine.
"""

from __future__ import annotations

import sys
from typing import Any


def import_onnxruntime() -> Any:
    """Import onnxruntime without its import-time self-check loading the original ORTModule.

    ``onnxruntime/__init__.py`` validates the build by importing ``onnxruntime.training.ortmodule``
    (the Python package we replace). On current PyTorch that import fails slowly (tens of
    seconds) and it must never run in our process, so it is blocked for the duration of the
    import; the engine's C++ API in ``onnxruntime.capi`` does not need it.
    """
    already = sys.modules.get("onnxruntime")
    if already is not None:
        return already
    blocked = "onnxruntime.training"
    present = blocked in sys.modules
    if not present:
        sys.modules[blocked] = None  # type: ignore[assignment]
    try:
        import onnxruntime
    finally:
        if not present and sys.modules.get(blocked, 0) is None:
            del sys.modules[blocked]
    return onnxruntime


_BOUND: Any = None


def _C() -> Any:
    """The engine's ``_pybind_state`` (looked up once: this sits on every step's path)."""
    global _BOUND
    if _BOUND is None:
        _BOUND = _bind_engine()
    return _BOUND


def _bind_engine() -> Any:
    try:
        import_onnxruntime()
        from onnxruntime.capi import _pybind_state as C
    except ImportError as err:  # pragma: no cover - depends on the installed engine
        raise ImportError(
            "ONNX Runtime's training engine is not installed. Install one of: "
            "`pip install ortmodule[cpu]` (onnxruntime-training-cpu) or "
            "`pip install ortmodule[cuda]` (onnxruntime-training)."
        ) from err
    if not hasattr(C, "TrainingAgent"):
        raise ImportError(
            "the installed onnxruntime has no training engine (plain `onnxruntime` is inference "
            "only). Uninstall it and install onnxruntime-training-cpu or onnxruntime-training."
        )
    return C
