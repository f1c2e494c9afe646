"""A named, ordered set of passes: the one registry behind post-export and built-graph passes.

>>> passes = OrderedPasses()
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

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Pass(Generic[F]):
    name: str
    fn: F
    order: int


class OrderedPasses(Generic[F]):
    """Passes by name; a new registration under a name replaces the old one. They run by
    ``order``, lower first, then by name, so the order never depends on import order."""

    def __init__(self) -> None:
        self._passes: dict[str, Pass[F]] = {}
        self._lock = threading.Lock()

    def register(self, name: str, fn: F, order: int = 100) -> None:
        if not callable(fn):
            raise TypeError(f"pass {name!r}: fn must be callable, got {type(fn).__name__}")
        with self._lock:
            self._passes[name] = Pass(name, fn, order)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._passes.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._passes

    def in_order(self) -> list[Pass[F]]:
        with self._lock:
            return sorted(self._passes.values(), key=lambda p: (p.order, p.name))
