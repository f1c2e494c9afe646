"""Reused buffers for the outputs of PyTorch-run nodes: no page faults on fresh memory each step.

An ATen node that writes a large output into a tensor PyTorch has just allocated pays for
first touching that memory: glibc hands out blocks of more than its ``mmap`` threshold as fresh
pages, and gives freed heap tops back to the system, so the same 4 MB GELU gradient faults its
1024 pages in again at every step (on the 2-core EPYC VM, 2500-6900 page faults a training
step of the BERT benchmark, about 1 us each). The engine's own outputs do not: its
arena keeps what it allocated.

:func:`empty` gives such an output the memory of an earlier one of its size class that nobody
holds any more: the engine has released it (the ``DLManagedTensor`` it was handed), and no
tensor, view or DLPack export of it is left anywhere. That is read from the storage's use
count, so a buffer that anybody still holds (a saved activation, a user's output, a view kept
by PyTorch) is never handed out again. Sizes are rounded up to 8 classes per power of two
(:func:`size_class`), so the outputs of batches of other lengths share buffers too. Like the
engine's arena, the pool keeps about the peak of what was in use at once, and never more than
:data:`MAX_BYTES`: beyond it idle buffers are freed, least recently used first, and an output
that still does not fit is allocated as usual. :func:`clear` gives the idle buffers back, and
:func:`empty_unpooled` frees idle ones to make room for a large tensor the pool will not own.

Used where our own code allocates an output: elementwise operators written with ``out=``
(GELU and its backward, ``parallel.elementwise``) and the pieces of a node cut along the batch
(``parallel.in_rows``). CPU tensors of at least :data:`MIN_BYTES` only: smaller blocks come
from the heap without faults, and CUDA has PyTorch's caching allocator.

>>> buf = empty((512, 256), torch.float32)   # fresh, or an idle buffer of 512 KiB
>>> buf.shape
torch.Size([512, 256])
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from ..heap import release_free_pages

__all__ = [
    "MAX_BYTES",
    "MIN_BYTES",
    "TRIM_BYTES",
    "clear",
    "empty",
    "empty_output",
    "empty_unpooled",
    "size_class",
    "stats",
]

#: outputs smaller than this are allocated as usual (glibc serves them from its heap)
MIN_BYTES = 1 << 18
#: a tensor the pool does not own this large (glibc's largest ``mmap`` threshold: always fresh
#: pages) also hands the heap's free pages back after making room (:func:`empty_unpooled`)
TRIM_BYTES = 32 << 20
#: what the pool may hold in all; to stay under it idle buffers go, least recently used first,
#: and an output that does not fit is allocated as usual
MAX_BYTES = 256 << 20

# torch's count of references to a storage; without it nothing is pooled
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _Buffer:
    __slots__ = ("data", "idle", "used")

    def __init__(self, data: torch.Tensor, tick: int) -> None:
        self.data = data
        #: the storage's use count while only the pool holds it
        self.idle = _count(data)
        self.used = tick

    def is_idle(self) -> bool:
        return _count(self.data) == self.idle


_LOCK = threading.Lock()
#: size class in bytes -> its buffers
_BUFFERS: dict[int, list[_Buffer]] = {}
_STATS = {"reused": 0, "allocated": 0}
_TICK = [0]


def _count(data: torch.Tensor) -> int:
    assert _use_count is not None
    return int(_use_count(data.untyped_storage()._cdata))


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of 8 steps per power of two (at most 1/8 more): outputs of
    nearby sizes (a batch of another length) share buffers."""
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


def _held() -> int:
    return sum(size * len(buffers) for size, buffers in _BUFFERS.items())


def _free_idle(enough: int) -> int:
    """Free idle buffers, least recently used first, until ``enough`` bytes are freed or none
    is idle left; returns the bytes freed."""
    idle = sorted(
        ((b.used, size, b) for size, buffers in _BUFFERS.items() for b in buffers if b.is_idle()),
        key=lambda entry: entry[0],
    )
    freed = 0
    for _used, size, buffer in idle:
        if freed >= enough:
            break
        _BUFFERS[size].remove(buffer)
        freed += size
    return freed


def _evict(needed: int) -> bool:
    """Free idle buffers, least recently used first, until ``needed`` more bytes fit."""
    room = MAX_BYTES - _held()
    if room >= needed:
        return True
    return room + _free_idle(needed - room) >= needed


def empty(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """An uninitialised contiguous tensor, on an idle pooled buffer when it is large enough."""
    device = device or torch.device("cpu")
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _use_count is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    size = size_class(nbytes)
    with _LOCK:
        _TICK[0] += 1
        buffers = _BUFFERS.setdefault(size, [])
        buffer = next((b for b in buffers if b.is_idle()), None)
        if buffer is not None:
            buffer.used = _TICK[0]
            _STATS["reused"] += 1
        elif _evict(size):
            buffer = _Buffer(torch.empty(size, dtype=torch.uint8), _TICK[0])
            buffers.append(buffer)
            _STATS["allocated"] += 1
        else:
            return torch.empty(tuple(shape), dtype=dtype)
        return buffer.data[:nbytes].view(dtype).view(tuple(shape))


def empty_unpooled(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A new uninitialised tensor the pool will not own: an output the user keeps (a weight's
    gradient). On the CPU, one of :data:`MIN_BYTES` or more first frees as many bytes of idle
    buffers, least recently used first, for the C library to give it: the backward's weight
    gradients take the room of the forward's pooled buffers instead of new memory. One of
    :data:`TRIM_BYTES` or more, which glibc maps fresh whatever its heap holds, also hands the
    heap's free pages back. At GPT-2 124M the pool held 171 MiB idle both where the LM head's
    154 MB weight gradient is allocated and at the end of the backward, when every gradient
    is: the steps peak went 3350-3367 -> 3188-3213 MiB for the first, 3146-3209 -> 3063-3123
    for all of them (the step time within the runs' noise, 0-4 % more)."""
    device = device or torch.device("cpu")
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type == "cpu" and nbytes >= MIN_BYTES and _use_count is not None:
        with _LOCK:
            freed = _free_idle(nbytes)
        if freed and nbytes >= TRIM_BYTES:
            release_free_pages()
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_output(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | None, kept_by_user: bool
) -> torch.Tensor:
    """An ATen node's output: :func:`empty_unpooled` where the user keeps it (a graph output,
    a weight's gradient), else :func:`empty`."""
    return (empty_unpooled if kept_by_user else empty)(shape, dtype, device)


def clear() -> int:
    """Give the idle buffers back (those still held stay pooled); returns the bytes freed."""
    freed = 0
    with _LOCK:
        for size, buffers in _BUFFERS.items():
            kept = [b for b in buffers if not b.is_idle()]
            freed += size * (len(buffers) - len(kept))
            buffers[:] = kept
    return freed


def stats() -> dict[str, int]:
    """``reused``/``allocated``: outputs given a pooled buffer again / a new one; ``bytes``:
    what the pool holds now."""
    with _LOCK:
        return {**_STATS, "bytes": _held()}
