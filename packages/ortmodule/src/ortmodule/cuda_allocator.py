"""PyTorch's CUDA caching allocator handed to the engine through ctypes callbacks.

ONNX Runtime's CUDA execution provider accepts three function addresses
(``gpu_external_alloc``, ``gpu_external_free``, ``gpu_external_empty_cache``). We make them with
``ctypes.CFUNCTYPE`` around ``torch.cuda.caching_allocator_alloc`` / ``_delete`` and
``torch.cuda.empty_cache``, so both share one memory pool and nothing is compiled.
"""

from __future__ import annotations

import ctypes

import torch

_AllocFn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)
_FreeFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_EmptyFn = ctypes.CFUNCTYPE(None)


def _alloc(size: int) -> int:
    return int(torch.cuda.caching_allocator_alloc(size))


def _free(ptr: int) -> None:
    if ptr:
        torch.cuda.caching_allocator_delete(ptr)


def _empty() -> None:
    torch.cuda.empty_cache()


# module-level references keep the callbacks alive for the life of the process
_CALLBACKS = (_AllocFn(_alloc), _FreeFn(_free), _EmptyFn(_empty))


def addresses() -> tuple[int, int, int]:
    alloc, free, empty = (ctypes.cast(cb, ctypes.c_void_p).value for cb in _CALLBACKS)
    assert alloc and free and empty
    return alloc, free, empty
