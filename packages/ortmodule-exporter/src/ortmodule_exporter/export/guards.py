"""Guards: where the trace turned a tensor into a Python value, the value is checked each step.

A TorchScript trace records tensor operations only. ``if y.sum() > 0``, ``float(x.max())``,
``int(mask.sum())``, ``t.item()`` and ``t.tolist()`` give Python values that steer the Python
around the operations, and the trace keeps whatever they were on the traced call. Replaying that
graph on other inputs gives silently wrong results.

While the module is traced, :func:`recording_conversions` notes every such conversion: the
tensor (a value of the traced graph), the Python value it gave and the user's source line. The
exporter returns each tensor as an extra graph output (``guard.<n>``), so every run of the graph
also computes what the conversion would give now; the runtime compares it with the value the
graph was built for (:meth:`Guard.holds`) before it hands anything back, and on a change runs or
builds the graph for the new value instead.

>>> import torch
>>> with recording_conversions() as seen:
...     _ = bool(torch.tensor(1.0) > 0)
>>> [g.kind for g in seen]  # nothing is traced outside an export
[]
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ExportError

__all__ = ["Guard", "GuardError", "guard_output_name", "recording_conversions"]

GUARD_PREFIX = "guard."


def guard_output_name(index: int) -> str:
    return f"{GUARD_PREFIX}{index}"


class GuardError(ExportError):
    """A Python value the module computes from a tensor keeps changing between calls, so no
    exported graph can follow it (the fallback policy treats it as an unsupported model)."""


@dataclass(frozen=True)
class Guard:
    """One tensor -> Python conversion seen while tracing, and the value it gave."""

    #: ``bool``, ``int``, ``float``, ``item``, ``tolist`` or ``index``
    kind: str
    #: the tensor's value when the graph was traced
    value: torch.Tensor
    #: ``file:line: code`` of the user's frame that converted it
    source: str

    @property
    def discrete(self) -> bool:
        """Whether the value is likely to repeat (a branch taken, a count): a float that
        changed will keep changing, so a graph per float value is never built."""
        return not self.value.is_floating_point() or self.kind in ("bool", "index")

    def holds(self, now: torch.Tensor) -> bool:
        """Whether the graph's current value equals the traced one (NaN equals NaN)."""
        if now.numel() == 1 and self.value.numel() == 1:  # the usual case, ~1 us
            was, is_ = self.value.item(), now.item()
            return bool(was == is_ or (was != was and is_ != is_))
        return _same(self.value, now)

    def describe(self, now: torch.Tensor | None = None) -> str:
        was = _show(self.value)
        if now is None:
            return f"{self.kind}() at {self.source} (was {was})"
        return f"{self.kind}() at {self.source}: {was} -> {_show(now)}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    b = b.to(a.device)
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def _show(t: torch.Tensor) -> str:
    if t.numel() == 1:
        value = t.reshape(()).item()
        return repr(value)
    return f"tensor of shape {list(t.shape)}"


# the conversions a trace bakes in: Tensor attribute -> guard kind
_CONVERSIONS = {
    "__bool__": "bool",
    "__int__": "int",
    "__float__": "float",
    "__index__": "index",
    "item": "item",
    "tolist": "tolist",
}
# ``len(t)`` needs no entry: under the tracer ``Tensor.__len__`` returns the traced size, which
# Python turns into an int through ``__index__``

_ACTIVE = threading.local()
_LOCK = threading.Lock()
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)), _HERE)


def _user_source() -> str:
    """``file:line: code`` of the innermost frame outside torch and the exporter."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_SKIPPED_DIRS):
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            return f"{where}: {code}" if code else where
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def _recorder(attr: str, kind: str, original: Any) -> Any:
    def convert(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        seen = getattr(_ACTIVE, "seen", None)
        if seen is None or not torch.jit.is_tracing():
            return result
        if kind == "index" and any(self is bound for bound in _ACTIVE.slice_bounds):
            return result  # a slice bound: the tracer records it as a value (see _subscript)
        seen.append(Guard(kind, self.detach().clone(), _user_source()))
        seen_tensors: list[torch.Tensor] = _ACTIVE.tensors
        seen_tensors.append(self)
        return result

    convert.__name__ = attr
    convert.__qualname__ = f"Tensor.{attr}"
    return convert


def _bounds(index: Any) -> list[torch.Tensor]:
    """The tensors among the start, stop and step of the slices in a subscript."""
    items = index if isinstance(index, tuple) else (index,)
    return [
        bound
        for item in items
        if isinstance(item, slice)
        for bound in (item.start, item.stop, item.step)
        if isinstance(bound, torch.Tensor)
    ]


class _SliceBounds(TorchFunctionMode):
    """While a tensor is subscripted, the tensors among its slice bounds convert to an int
    without a guard: the tracer keeps such a bound as a value of the graph (PyTorch's indexing
    stashes a tensor slice bound for the trace), so ``buffer[:, : x.shape[1]]`` follows the
    input's size and needs no re-export when it changes (CLIP's position ids). A mode rather
    than a patched ``Tensor.__getitem__``: a Python ``__getitem__`` on the class would make
    every tensor a sequence to C code (``torch.tensor([t])`` would call ``len`` on a 0-d ``t``).
    """

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        bounds = _bounds(args[1]) if func in _SUBSCRIPTS and len(args) > 1 else []
        if not bounds:
            return func(*args, **(kwargs or {}))
        active: list[torch.Tensor] = _ACTIVE.slice_bounds
        active.extend(bounds)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            del active[len(active) - len(bounds) :]


_SUBSCRIPTS = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


@contextmanager
def recording_conversions() -> Iterator[list[Guard]]:
    """Note each conversion of a traced tensor to a Python value on this thread.

    Yields the list of :class:`Guard` s it fills; :func:`converted_tensors` gives the traced
    tensors themselves (valid until the block ends), in the same order.
    """
    seen: list[Guard] = []
    with _LOCK:
        saved = {attr: torch.Tensor.__dict__.get(attr) for attr in _CONVERSIONS}
        for attr, kind in _CONVERSIONS.items():
            setattr(torch.Tensor, attr, _recorder(attr, kind, getattr(torch.Tensor, attr)))
    _ACTIVE.seen = seen
    _ACTIVE.tensors = []
    _ACTIVE.slice_bounds = []
    try:
        with _SliceBounds():
            yield seen
    finally:
        _ACTIVE.seen = None
        with _LOCK:
            for attr, before in saved.items():
                if before is None:
                    delattr(torch.Tensor, attr)
                else:
                    setattr(torch.Tensor, attr, before)


def converted_tensors() -> list[torch.Tensor]:
    """The traced tensors converted so far inside :func:`recording_conversions`."""
    return list(getattr(_ACTIVE, "tensors", []))
