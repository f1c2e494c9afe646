"""Give the C heap's free pages back to the system after a run of an engine session without
an arena (:func:`release_free_pages`).

A CPU session built without the engine's arena (``SessionConfig(cpu_arena=False)``: recompute,
DeepSpeed ZeRO, ``ORTMODULE_CPU_MEM_ARENA=0``) allocates each buffer with ``malloc`` and frees it
when the run is done with it, so that what a step held goes back. glibc does not give all of
it back: after a large block is freed it raises its ``mmap`` threshold (up to 32 MiB), so later
blocks below that size come from its heap, and freed heap memory stays resident in the process
for the next ``malloc``. After an engine backward that is the step's activations, and the
allocations that follow it (DeepSpeed's gradient partitions, the optimizer's temporaries) are
mostly larger blocks that the heap's free lists do not serve: they are resident on top of it.
``malloc_trim(0)`` hands every free heap page back (``MADV_DONTNEED``), in about 10 ms for a
few hundred MiB. On a C library without it (not glibc) nothing is done.

>>> release_free_pages() in (True, False)
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

__all__ = ["release_free_pages"]


@functools.cache
def _trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def release_free_pages() -> bool:
    """Hand the C heap's free pages back to the system; False where the C library cannot."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True
