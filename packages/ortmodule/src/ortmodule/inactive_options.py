"""One WARNING for each ``ORTMODULE_*`` variable set to a value that nothing installed acts on.

Some variables are honoured by components (``ortmodule-memory``, ``ortmodule-triton``,
``ortmodule-zero``) discovered at run time, some by nothing in this build; a user who sets one
must not believe it worked. ``ORTModule`` calls :func:`warn_inactive_options` after loading the
installed components:

>>> from ortmodule.options import RuntimeOptions
>>> warn_inactive_options(RuntimeOptions.defaults())
[]
"""

from __future__ import annotations

import logging
import threading

from ortmodule_exporter.components import handled_options
from ortmodule_exporter.engine_binding import import_onnxruntime

from .options import RuntimeOptions, inactive_variables

__all__ = ["cuda_engine", "warn_inactive_options"]

logger = logging.getLogger("ortmodule")

_WARNED: set[str] = set()
_LOCK = threading.Lock()


def cuda_engine() -> bool:
    """Whether the installed engine has the CUDA execution provider (False when none is installed)."""
    try:
        providers = import_onnxruntime().get_available_providers()
    except ImportError:
        return False
    return "CUDAExecutionProvider" in providers


def warn_inactive_options(options: RuntimeOptions) -> list[str]:
    """Log a WARNING, once per process and variable, for each variable that does nothing here;
    returns the messages logged by this call."""
    logged = []
    for name, message in inactive_variables(options, handled_options(), cuda_engine()):
        with _LOCK:
            if name in _WARNED:
                continue
            _WARNED.add(name)
        logger.warning(message)
        logged.append(message)
    return logged
