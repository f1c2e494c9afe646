"""The one state machine that decides when to (re)export and (re)build.

Every forward computes a :class:`GraphKey`. Each mode (training with gradients, training mode
without gradients, eval) keeps the graph it built last and the key it was built for: the same
key reuses it, a new key builds again and logs why at INFO. A graph replaced because the trace
state changed (autocast entered for training, left for evaluation) is kept, and taken back
when that state returns.

Example::

    manager = GraphTransitionManager()
    graph = manager.get(key, build=lambda: export_and_build(...))
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from ortmodule_pytree import Schema, describe_difference

logger = logging.getLogger("ortmodule.graph_transition")

T = TypeVar("T")

ParamSig = tuple[str, tuple[int, ...], torch.dtype, bool]


def parameter_signature(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[ParamSig, ...]:
    return tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in named)


def trace_state() -> tuple[Any, ...]:
    """The process state a trace reads besides the module and its inputs: autocast (device
    types, dtypes, weight-cast cache), the default dtype, the deterministic-algorithms flag,
    grad mode and inference mode. A forward may branch on any of them, and autocast puts its
    casts into the graph, so each is part of the graph key (about 2 us a call without autocast).

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     inside = trace_state()
    >>> inside != trace_state()
    True
    """
    autocast: tuple[Any, ...] = ()
    if torch._C._is_any_autocast_enabled():
        autocast = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        ) + (torch.is_autocast_cache_enabled(),)
    return (
        autocast,
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )


_AUTOCAST_DEVICES = ("cpu", "cuda")
_TRACE_STATE_NAMES = (
    "autocast",
    "default dtype",
    "deterministic algorithms",
    "grad mode",
    "inference mode",
)


@dataclass(frozen=True)
class GraphKey:
    """Everything that, when it changes, makes the built graph wrong."""

    input_schema: Schema
    training: bool
    build_gradient: bool
    device: str
    params: tuple[ParamSig, ...]
    options: tuple[tuple[str, Any], ...] = field(default=())
    #: :func:`trace_state` at the call
    state: tuple[Any, ...] = field(default=())
    #: which graph of a guarded family this is: empty for the first, else the guard that
    #: changed (see ``ortmodule_exporter.export.guards``)
    guards: tuple[str, ...] = field(default=())

    @property
    def mode(self) -> str:
        if self.build_gradient:
            return "training"
        return "training-mode inference" if self.training else "inference"

    def without_guards(self) -> GraphKey:
        """This key for the first graph of its guarded family."""
        return dataclasses.replace(self, guards=()) if self.guards else self


def describe_change(old: GraphKey | None, new: GraphKey) -> str:
    """Why ``new`` needs a new graph, in one readable line."""
    if old is None:
        return f"first {new.mode} call"
    if old.input_schema != new.input_schema:
        return describe_difference(old.input_schema, new.input_schema) or "input structure changed"
    if old.device != new.device:
        return f"device changed {old.device} -> {new.device}"
    if old.params != new.params:
        return _describe_params(old.params, new.params)
    if old.state != new.state:
        return (
            "; ".join(
                f"{name} changed {a!r} -> {b!r}"
                for name, a, b in zip(_TRACE_STATE_NAMES, old.state, new.state, strict=False)
                if a != b
            )
            or "trace state changed"
        )
    if old.guards != new.guards and new.guards:
        return new.guards[-1]
    if old.options != new.options:
        before, after = dict(old.options), dict(new.options)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        return "options changed: " + ", ".join(
            f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in changed
        )
    return "mode changed"


def _describe_params(old: tuple[ParamSig, ...], new: tuple[ParamSig, ...]) -> str:
    before = {p[0]: p for p in old}
    after = {p[0]: p for p in new}
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    if added:
        return f"parameter '{added[0]}' added" + (
            f" (+{len(added) - 1} more)" if len(added) > 1 else ""
        )
    if removed:
        return f"parameter '{removed[0]}' removed" + (
            f" (+{len(removed) - 1} more)" if len(removed) > 1 else ""
        )
    for name, (_, shape, dtype, req) in after.items():
        _, shape0, dtype0, req0 = before[name]
        if req != req0:
            return f"parameter '{name}' requires_grad changed {req0} -> {req}"
        if shape != shape0:
            return f"parameter '{name}' shape changed {list(shape0)} -> {list(shape)}"
        if dtype != dtype0:
            return f"parameter '{name}' dtype changed {dtype0} -> {dtype}"
    return "parameter order changed"


#: graphs kept per mode for other trace states (autocast on for training, off for evaluation) or
#: other size-1 dims of the inputs (the last batch of an epoch): going back to one switches to
#: it instead of exporting again
KEPT_STATES_PER_MODE = 4


class GraphTransitionManager(Generic[T]):
    """Keeps one built graph per mode and rebuilds exactly when its key changes; a graph left
    for another trace state or input shapes only (autocast entered or left; a batch of one,
    whose size-1 dim the graph keeps fixed) is kept, up to :data:`KEPT_STATES_PER_MODE` a
    mode, and taken back when that state or those shapes return."""

    def __init__(self) -> None:
        self._slots: dict[tuple[bool, bool], tuple[GraphKey, T]] = {}
        self._kept: dict[tuple[bool, bool], list[tuple[GraphKey, T]]] = {}
        self._lock = threading.Lock()
        #: how many times a graph was built (each build starts with an export or a cache hit)
        self.builds = 0
        #: the reason of each build, in order
        self.history: list[str] = []

    def get(self, key: GraphKey, build: Callable[[], T]) -> T:
        slot = (key.training, key.build_gradient)
        with self._lock:
            current = self._slots.get(slot)
            if current is not None and current[0] == key:
                return current[1]
            kept = self._kept.setdefault(slot, [])
            for i, (old_key, old_value) in enumerate(kept):
                if old_key == key:
                    del kept[i]
                    self._keep(slot, current, key)
                    self._slots[slot] = (key, old_value)
                    before = current[0] if current is not None else None
                    logger.info("graph switched (%s): %s", key.mode, describe_change(before, key))
                    return old_value
            self._keep(slot, current, key)
            reason = describe_change(current[0] if current else None, key)
            verb = "export" if current is None else "re-export"
            logger.info("%s (%s): %s", verb, key.mode, reason)
            value = build()
            self._slots[slot] = (key, value)
            self.builds += 1
            self.history.append(reason)
            return value

    def _keep(
        self, slot: tuple[bool, bool], current: tuple[GraphKey, T] | None, key: GraphKey
    ) -> None:
        """Keep the graph ``current`` that ``key`` replaces when they differ in trace state or
        input shapes only."""
        if current is None:
            return
        old = current[0]
        if dataclasses.replace(old, state=key.state, input_schema=key.input_schema) != key:
            return
        if old.input_schema.without_shapes() != key.input_schema.without_shapes():
            return
        kept = self._kept.setdefault(slot, [])
        kept.insert(0, current)
        del kept[KEPT_STATES_PER_MODE:]

    def switch(self, key: GraphKey, value: T, reason: str) -> None:
        """Make ``value``, built earlier for ``key``, the current graph of its mode again (a
        guard's value went back to one an earlier graph was built for)."""
        with self._lock:
            logger.info("graph switched (%s): %s", key.mode, reason)
            self._slots[(key.training, key.build_gradient)] = (key, value)

    def current(self, training: bool, build_gradient: bool) -> T | None:
        slot = self._slots.get((training, build_gradient))
        return slot[1] if slot else None

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._kept.clear()
