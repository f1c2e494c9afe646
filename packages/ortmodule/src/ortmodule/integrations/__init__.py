"""Support for third-party libraries, loaded only when the library is already in use.

``install_available()`` runs whenever an ``ORTModule`` is created or called: for each library
listed here that the process has already imported, it installs that library's support once.
Nothing here imports a library the user has not imported, so ``ortmodule`` keeps no
dependency on them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["install_available"]

_installed: set[str] = set()


def _transformers() -> None:
    from . import transformers

    transformers.install()


#: top-level module name -> installer of its support
_INSTALLERS: dict[str, Callable[[], None]] = {"transformers": _transformers}


def install_available() -> None:
    """Install support for every listed library that ``sys.modules`` holds (idempotent)."""
    if len(_installed) == len(_INSTALLERS):
        return
    for name, installer in _INSTALLERS.items():
        if name not in _installed and name in sys.modules:
            installer()
            _installed.add(name)
