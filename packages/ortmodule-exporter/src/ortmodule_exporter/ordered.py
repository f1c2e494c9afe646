"""A named, ordered registry: the one behind every plug-in kind of the exporter.

Post-export, batch and built-graph passes, symbolic layers, session contributors and step
hooks each keep one :class:`OrderedRegistry`. Entries run by ``order``, lower first, then by
name, so the order never depends on import order; a new registration under a name replaces the
old one. :meth:`OrderedRegistry.in_order` is computed once per change, so a hot path that asks
for it every step pays a tuple read.

>>> passes = OrderedRegistry()
>>> passes.register("b", print, order=20)
>>> passes.register("a", print, order=20)
>>> [p.name for p in passes.in_order()]
['a', 'b']
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["OrderedRegistry", "Registered"]

T = TypeVar("T")


@dataclass(frozen=True)
class Registered(Generic[T]):
    name: str
    fn: T
    order: int


class OrderedRegistry(Generic[T]):
    """Entries by name, in ``(order, name)`` order. ``check`` vets an entry before it is kept
    (by default it must be callable) and raises with a message naming it."""

    def __init__(self, check: Callable[[str, Any], None] | None = None) -> None:
        self._entries: dict[str, Registered[T]] = {}
        self._sorted: tuple[Registered[T], ...] = ()
        self._fns: tuple[T, ...] = ()
        self._version = 0
        self._lock = threading.Lock()
        self._check = check or _callable

    def register(self, name: str, fn: T, order: int = 100) -> None:
        self._check(name, fn)
        with self._lock:
            self._entries[name] = Registered(name, fn, order)
            self._changed()

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._entries.pop(name, None) is not None:
                self._changed()

    def _changed(self) -> None:
        self._sorted = tuple(sorted(self._entries.values(), key=lambda e: (e.order, e.name)))
        self._fns = tuple(e.fn for e in self._sorted)
        self._version += 1

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __bool__(self) -> bool:
        return bool(self._sorted)

    def in_order(self) -> tuple[Registered[T], ...]:
        return self._sorted

    def fns(self) -> tuple[T, ...]:
        """The registered objects in order: the same tuple object until the next change."""
        return self._fns

    @property
    def version(self) -> int:
        """A number that changes with every registration or removal (for caches keyed on it)."""
        return self._version


def _callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"{name!r}: fn must be callable, got {type(fn).__name__}")
