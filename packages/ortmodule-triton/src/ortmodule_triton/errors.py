"""The errors of Triton code generation: each names the node or tensor and what to do."""

from __future__ import annotations

__all__ = ["TritonCodegenError", "TritonConfigError"]


class TritonCodegenError(ValueError):
    """An ONNX subgraph that the code generator cannot turn into one Triton kernel."""


class TritonConfigError(ValueError):
    """A malformed ``ORTMODULE_*`` Triton option or fusion config file."""
