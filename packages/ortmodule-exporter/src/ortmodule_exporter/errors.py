"""Exceptions raised by the exporter.

The runtime's fallback catches :class:`ExportError` (and its subclasses) to decide whether
training can continue in PyTorch; every message names the thing that failed and what to do.
"""

from __future__ import annotations


class ORTModuleError(Exception):
    """Base class of every error ORTModule raises on purpose."""


class ExportError(ORTModuleError):
    """The module could not be exported to ONNX.

    ``module_path`` is the qualified class of the module, ``op`` the ATen operator that failed
    when one could be identified, ``called_in`` the submodule that calls it (``"model.layers.0"``,
    ``""`` for the module's own forward, None when unknown); the original error is chained as
    ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        module_path: str = "",
        op: str | None = None,
        called_in: str | None = None,
    ) -> None:
        super().__init__(message)
        self.module_path = module_path
        self.op = op
        self.called_in = called_in


class UnsupportedOutputError(ExportError, TypeError):
    """The module returned something that cannot cross the engine boundary."""


class EngineBuildError(ORTModuleError):
    """The engine could not build the gradient graph or create a session for the model."""


class InvalidOptionError(ORTModuleError, ValueError):
    """An option or ``ORTMODULE_*`` environment variable holds a value we do not accept."""
