"""The ctypes plumbing under the engine's Python callbacks: DLPack pointers and ``std::vector``.

The engine calls two kinds of native callbacks that we write in Python, with nothing compiled:

* the ATen executor receives and returns ``DLManagedTensor*`` (plain C);
* the PythonOp runners receive ``const std::vector<...>&`` arguments and return a
  ``std::vector<PyObject*>`` by value. Under the Itanium C++ ABI (Linux, x86-64 and aarch64)
  a by-value ``std::vector`` is returned through a hidden first pointer argument that the caller
  allocates and later destroys, and the vector is three pointers ``[begin, end, end_of_storage]``
  (libstdc++ and libc++ agree). We fill that memory with a buffer from the same global
  ``operator new`` the engine's ``operator delete`` frees.

>>> import torch
>>> from ortmodule_exporter.dlpack_bridge import managed_pointer, tensor_from_pointer
>>> tensor_from_pointer(managed_pointer(torch.arange(3))).tolist()
[0, 1, 2]
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

# the C entry points behind torch.utils.dlpack, without its Python-level dispatch (hot path)
_from_capsule = getattr(torch._C, "_from_dlpack", from_dlpack)
_to_capsule = getattr(torch._C, "_to_dlpack", to_dlpack)

__all__ = [
    "managed_pointer",
    "object_from_pointer",
    "read_int64_vector",
    "read_pointer_vector",
    "tensor_from_capsule",
    "tensor_from_pointer",
    "tensor_to_capsule",
    "write_object_vector",
]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_void_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_void_p]
_api.Py_IncRef.restype = None
_api.Py_IncRef.argtypes = [ctypes.py_object]

# A capsule keeps the *pointer* to its name, so the names must outlive every capsule.
_DLTENSOR = ctypes.create_string_buffer(b"dltensor")
_USED_DLTENSOR = ctypes.create_string_buffer(b"used_dltensor")


class _StdVector(ctypes.Structure):
    _fields_ = [
        ("begin", ctypes.c_void_p),
        ("end", ctypes.c_void_p),
        ("end_of_storage", ctypes.c_void_p),
    ]


def _operator_new() -> Any:
    if not sys.platform.startswith("linux"):  # pragma: no cover - the engine ships for Linux only
        return None
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    fn = ctypes.CDLL(name)._Znwm  # ::operator new(size_t)
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_size_t]
    return fn


_NEW = _operator_new()


def tensor_from_pointer(address: int) -> torch.Tensor:
    """A tensor over the ``DLManagedTensor*`` at ``address``; torch now owns it and calls its deleter."""
    capsule = _api.PyCapsule_New(address, ctypes.addressof(_DLTENSOR), None)
    return _from_capsule(capsule)


def managed_pointer(tensor: torch.Tensor) -> int:
    """A ``DLManagedTensor*`` for ``tensor`` whose ownership passes to the caller (the engine)."""
    capsule = _to_capsule(tensor)
    address = _api.PyCapsule_GetPointer(capsule, ctypes.addressof(_DLTENSOR))
    # torch's capsule destructor frees only capsules still named "dltensor"
    _api.PyCapsule_SetName(capsule, ctypes.addressof(_USED_DLTENSOR))
    return int(address)


def tensor_from_capsule(capsule: Any) -> torch.Tensor:
    return _from_capsule(capsule)  # type: ignore[no-any-return]


def tensor_to_capsule(tensor: torch.Tensor) -> Any:
    return _to_capsule(tensor)


def object_from_pointer(address: int) -> Any:
    """The Python object whose ``PyObject*`` is ``address`` (a new reference to it)."""
    return ctypes.cast(address, ctypes.py_object).value


def _span(address: int, item: Any) -> Any:
    vec = _StdVector.from_address(address)
    if not vec.begin:
        return []
    size = vec.end - vec.begin
    if size < 0 or size % ctypes.sizeof(item) or (vec.end_of_storage or 0) < vec.end:
        raise RuntimeError(f"unexpected std::vector layout at {address:#x}")
    return (item * (size // ctypes.sizeof(item))).from_address(vec.begin)


def read_int64_vector(address: int) -> list[int]:
    """The elements of the ``const std::vector<int64_t>&`` at ``address``."""
    return list(_span(address, ctypes.c_int64))


def read_pointer_vector(address: int) -> list[int]:
    """The elements of the ``const std::vector<T*>&`` at ``address``, as integers (0 for null)."""
    return [p or 0 for p in _span(address, ctypes.c_void_p)]


def write_object_vector(address: int, objects: Sequence[Any]) -> None:
    """Construct a ``std::vector<PyObject*>`` holding new references to ``objects`` at ``address``.

    ``address`` is uninitialised memory owned by the C++ caller, which destroys the vector.
    """
    vec = _StdVector.from_address(address)
    count = len(objects)
    if count == 0:
        vec.begin = vec.end = vec.end_of_storage = None
        return
    if _NEW is None:  # pragma: no cover
        raise RuntimeError("PythonOp runners need the C++ runtime's operator new (Linux only)")
    size = count * ctypes.sizeof(ctypes.c_void_p)
    buffer = _NEW(size)
    items = (ctypes.c_void_p * count).from_address(buffer)
    for i, obj in enumerate(objects):
        _api.Py_IncRef(obj)
        items[i] = id(obj)
    vec.begin = buffer
    vec.end = buffer + size
    vec.end_of_storage = buffer + size
