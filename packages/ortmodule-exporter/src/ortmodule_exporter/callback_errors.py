"""Exceptions raised by our code while the engine called it back (PythonOp, ATen nodes).

A native callback must not let an exception unwind through the engine. It keeps the exception
here and makes the engine fail the node; :func:`user_errors`, around the engine call, then raises
the kept exception, with its own traceback and a note naming what raised it, instead of the
engine's generic error.

>>> from ortmodule_exporter.callback_errors import user_errors
>>> with user_errors():
...     pass
"""

from __future__ import annotations

import threading
from typing import Any, Literal

__all__ = ["remember", "take_pending_error", "user_errors"]

_PENDING = threading.local()


def remember(err: BaseException, note: str) -> None:
    """Keep ``err`` (raised inside an engine callback on this thread) with ``note`` attached."""
    if hasattr(err, "add_note") and note not in getattr(err, "__notes__", ()):
        err.add_note(note)
    if getattr(_PENDING, "error", None) is None:  # the first error is the cause of the others
        _PENDING.error = err


def take_pending_error() -> BaseException | None:
    """The exception kept since the last call on this thread, if any (and forget it)."""
    err = getattr(_PENDING, "error", None)
    _PENDING.error = None
    return err


class _UserErrors:
    """A class, not a generator context manager: it wraps every engine call of every step."""

    __slots__ = ()

    def __enter__(self) -> None:
        _PENDING.error = None

    def __exit__(self, kind: Any, engine_error: BaseException | None, tb: Any) -> Literal[False]:
        if engine_error is None:
            return False
        user = take_pending_error()
        if user is None or user is engine_error:
            return False
        raise user.with_traceback(user.__traceback__) from None


_USER_ERRORS = _UserErrors()


def user_errors() -> _UserErrors:
    """Around an engine call: a callback's exception replaces the engine's error."""
    return _USER_ERRORS
