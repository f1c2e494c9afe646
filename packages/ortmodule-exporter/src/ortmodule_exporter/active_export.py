"""The export configuration in force in this thread (and asyncio task), and nothing else.

An export passes its :class:`~ortmodule_exporter.export.config.ExportConfig` down through a
:class:`contextvars.ContextVar`: the symbolics, routes and kernel choice read their switches
from it while the export runs, so nothing is installed into a module and two exports in two
threads never see each other's switches. Outside an export the readers fall back to the
process defaults their modules keep (``configure_aten_routes`` and the like), which only
``export()`` calls without a config use.

>>> active_export_config() is None
True
>>> with export_config_active("a config"):
...     active_export_config()
'a config'
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["active_export_config", "export_config_active"]

# Any: the ExportConfig, which this leaf cannot import (export.config imports its readers)
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "ortmodule_active_export_config", default=None
)


def active_export_config() -> Any:
    """The ExportConfig of the export running in this context, or None outside one."""
    return _ACTIVE.get()


@contextlib.contextmanager
def export_config_active(config: Any) -> Iterator[None]:
    """Make ``config`` the one in force in this context until the block ends (nestable)."""
    token = _ACTIVE.set(config)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
