"""Hold back what the engine prints on the process's stdout while it analyses a graph.

The engine's memory optimizer writes one line per transformer-layer boundary straight to file
descriptor 1 (C++ ``std::cout``), bypassing Python and ONNX Runtime's logger; a probe would
otherwise print dozens of lines on every rank. The text is kept and returned so it can be
logged at DEBUG.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["held_stdout"]


@contextmanager
def held_stdout(into: list[str]) -> Iterator[None]:
    """Redirect fd 1 to a temporary file for the block; its text is appended to ``into``."""
    try:
        fd = sys.stdout.fileno() if sys.stdout is not None else 1
    except (AttributeError, OSError, ValueError):  # pytest capture, notebooks: no real fd
        fd = 1
    if sys.stdout is not None:
        sys.stdout.flush()  # Python's buffered text goes out before the descriptor moves
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            into.append(tmp.read().decode("utf-8", errors="replace"))
