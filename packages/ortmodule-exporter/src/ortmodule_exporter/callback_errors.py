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

import contextlib
import threading
from collections.abc import Iterator

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


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Around an engine call: a callback's exception replaces the engine's error."""
    _PENDING.error = None
    try:
        yield
    except BaseException as engine_error:
        user = take_pending_error()
        if user is None or user is engine_error:
            raise
        raise user.with_traceback(user.__traceback__) from None
