"""Reused buffers for the outputs of PyTorch-run nodes: no page faults on fresh memory each step.

An ATen node that writes a large output into a tensor PyTorch has just allocated pays for
first touching that memory: glibc hands out blocks of more than its ``mmap`` threshold as fresh
pages, and gives freed heap tops back to the system, so the same 4 MB GELU gradient faults its
1024 pages in again at every step (on the 2-core EPYC VM, 4000-5000 page faults a training
step of the BERT and GPT benchmarks, about 1 us each). The engine's own outputs do not: its
arena keeps what it allocated.

:func:`empty` gives such an output the memory of an earlier one of the same size that nobody
holds any more: the engine has released it (the ``DLManagedTensor`` it was handed), and no
tensor, view or DLPack export of it is left anywhere. That is read from the storage's use
count, so a buffer that anybody still holds (a saved activation, a user's output, a view kept
by PyTorch) is never handed out again. The pool holds at most :data:`MAX_PER_SIZE` buffers of
each size, so it keeps, like the engine's arena, about the peak of what was in use at once;
:func:`clear` gives its idle buffers back.

Used where our own code allocates an output: elementwise operators written with ``out=``
(GELU and its backward, ``parallel.elementwise``) and the pieces of a node cut along the batch
(``parallel.in_rows``). CPU tensors of at least :data:`MIN_BYTES` only: smaller blocks come
from the heap without faults, and CUDA has PyTorch's caching allocator.

>>> buf = empty((512, 256), torch.float32)   # fresh, or an idle buffer of 512 KiB
>>> buf.shape
torch.Size([512, 256])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["MAX_PER_SIZE", "MIN_BYTES", "clear", "empty", "stats"]

#: outputs smaller than this are allocated as usual (glibc serves them from its heap)
MIN_BYTES = 1 << 18
#: buffers of one size the pool keeps; beyond it (outputs somebody keeps, say) allocation is as usual
MAX_PER_SIZE = 64

# torch's count of references to a storage; without it nothing is pooled
_use_count = getattr(torch._C, "_storage_Use_Count", None)

_LOCK = threading.Lock()
#: size in bytes -> [(byte buffer, its storage's use count while only the pool holds it)]
_BUFFERS: dict[int, list[tuple[torch.Tensor, int]]] = {}
_STATS = {"reused": 0, "allocated": 0}


def _count(buffer: torch.Tensor) -> int:
    assert _use_count is not None
    return int(_use_count(buffer.untyped_storage()._cdata))


def empty(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """An uninitialised contiguous tensor, on an idle pooled buffer when it is large enough."""
    device = device or torch.device("cpu")
    numel = 1
    for size in shape:
        numel *= int(size)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MIN_BYTES or _use_count is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    with _LOCK:
        buffers = _BUFFERS.setdefault(nbytes, [])
        for buffer, idle in buffers:
            if _count(buffer) == idle:
                _STATS["reused"] += 1
                return buffer.view(dtype).view(tuple(shape))
        if len(buffers) >= MAX_PER_SIZE:
            return torch.empty(tuple(shape), dtype=dtype)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffers.append((buffer, _count(buffer)))
        _STATS["allocated"] += 1
        return buffer.view(dtype).view(tuple(shape))


def clear() -> int:
    """Give the idle buffers back (those still held stay pooled); returns the bytes freed."""
    freed = 0
    with _LOCK:
        for nbytes, buffers in _BUFFERS.items():
            kept = [(b, idle) for b, idle in buffers if _count(b) != idle]
            freed += nbytes * (len(buffers) - len(kept))
            buffers[:] = kept
    return freed


def stats() -> dict[str, int]:
    """``reused``/``allocated``: outputs given a pooled buffer again / a new one; ``bytes``:
    what the pool holds now."""
    with _LOCK:
        held = sum(n * len(b) for n, b in _BUFFERS.items())
        return {**_STATS, "bytes": held}
