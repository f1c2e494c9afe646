"""The entry point the runtime discovers (group ``ortmodule.components``)."""

from __future__ import annotations

import importlib.util

from ortmodule_exporter.components import Component

from .graph_pass import register_triton_pass
from .options import OPTIONS

__all__ = ["COMPONENT"]


def _check() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    return None


COMPONENT = Component(
    name="ortmodule-triton",
    version="0.1.0",
    register=register_triton_pass,
    options=OPTIONS,
    check=_check,
    summary="ONNX subgraphs as generated Triton kernels (CUDA engine; CPU: verification only)",
)
