"""Our registry of ONNX symbolic functions, and the table one export uses.

A symbolic turns one ATen operator into ONNX nodes during the TorchScript export. The table an
export uses is a function of its configuration alone (:func:`symbolic_table`): the symbolics
registered here (ours and the user's), with each registered *layer* on top. A layer (the
PythonOp export, the ATen routes, the kernel choice) says, for a configuration, which operators
it takes over; its symbolic is made with the one below it, to hand back the cases it does not
take. The table is installed into torch.onnx for the export only and removed afterwards, so a
user's own ``torch.onnx.export`` calls elsewhere in the process see PyTorch's defaults.

Example::

    from torch.onnx import symbolic_helper as sh
    from ortmodule_exporter import register_symbolic

    @sh.parse_args("v")
    def my_relu(g, x):
        return g.op("Relu", x)

    register_symbolic("aten::relu", my_relu)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..ordered import OrderedRegistry
from ..torchscript_onnx import symbolic_opset

SymbolicFn = Callable[..., Any]


@dataclass(frozen=True)
class SymbolicEntry:
    op: str
    fn: SymbolicFn
    opset: int


_REGISTRY: dict[str, SymbolicEntry] = {}
#: bumped with every change of ``_REGISTRY`` (the tables made from it are cached)
_VERSION = [0]
_LOCK = threading.RLock()


@dataclass(frozen=True)
class LayerSymbolic:
    """One operator a layer takes over: ``make(below)`` is its symbolic, given the entry it
    covers (None: no symbolic of ours, PyTorch's own applies), from ``opset`` upwards."""

    op: str
    make: Callable[[SymbolicEntry | None], SymbolicFn]
    opset: int


#: config -> the operators the layer takes over for that configuration
SymbolicLayer = Callable[[Any], Iterable[LayerSymbolic]]

_LAYERS: OrderedRegistry[SymbolicLayer] = OrderedRegistry()
_TABLES: dict[tuple[Any, int, int], dict[str, SymbolicEntry]] = {}
_MAX_TABLES = 32


def _qualify(op: str) -> str:
    return op if "::" in op else f"aten::{op}"


def register_symbolic(op: str, fn: SymbolicFn, opset: int = 1) -> None:
    """Use ``fn`` to export ``op`` (``"aten::name"`` or ``"name"``) from ``opset`` upwards.

    A later registration for the same op replaces the earlier one.
    """
    if not callable(fn):
        raise TypeError(f"register_symbolic({op!r}, ...): the symbolic must be callable")
    with _LOCK:
        _REGISTRY[_qualify(op)] = SymbolicEntry(_qualify(op), fn, opset)
        _VERSION[0] += 1


def unregister_symbolic(op: str) -> None:
    with _LOCK:
        if _REGISTRY.pop(_qualify(op), None) is not None:
            _VERSION[0] += 1


def registered_symbolics() -> dict[str, SymbolicEntry]:
    with _LOCK:
        return dict(_REGISTRY)


def register_symbolic_layer(name: str, layer: SymbolicLayer, order: int) -> None:
    """Put ``layer`` on the table of every export, above the layers of lower ``order``.

    >>> def upper(config):
    ...     if config.custom_autograd:
    ...         yield LayerSymbolic("aten::relu", lambda below: my_relu, 9)
    >>> register_symbolic_layer("relu_when_autograd", upper, order=50)
    """
    _LAYERS.register(name, layer, order)


def unregister_symbolic_layer(name: str) -> None:
    _LAYERS.unregister(name)


def symbolic_table(config: Any) -> dict[str, SymbolicEntry]:
    """The symbolics an export of ``config`` (an ``ExportConfig``) uses: the registered ones,
    then each layer in order over them. The same configuration gives the same table (the
    same function objects) until a symbolic or a layer is registered or removed."""
    with _LOCK:
        key = (config, _VERSION[0], _LAYERS.version)
        table = _TABLES.get(key)
        if table is not None:
            return table
        table = dict(_REGISTRY)
        for layer in _LAYERS.in_order():
            for item in layer.fn(config):
                below = table.get(item.op)
                table[item.op] = SymbolicEntry(item.op, item.make(below), item.opset)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = table
        return table


def below_or(below: SymbolicEntry | None, fallback: Callable[[], SymbolicFn]) -> SymbolicFn:
    """What a layer's symbolic hands a case it does not take: the entry it covers where that
    applies at the export's opset, else ``fallback()`` (PyTorch's own symbolic)."""

    def default(g: Any, *args: Any) -> Any:
        if below is not None and g.opset >= below.opset:
            return below.fn(g, *args)
        return fallback()(g, *args)

    return default


def over_below(
    symbolic: Callable[..., Any], fallback: Callable[[], SymbolicFn]
) -> Callable[[SymbolicEntry | None], SymbolicFn]:
    """A :class:`LayerSymbolic` ``make`` for ``symbolic(default, g, *args)``, which calls
    ``default(g, *args)`` for the cases it leaves to the entry below (:func:`below_or`)."""

    def make(below: SymbolicEntry | None) -> SymbolicFn:
        default = below_or(below, fallback)

        @functools.wraps(symbolic)
        def layered(g: Any, *args: Any) -> Any:
            return symbolic(default, g, *args)

        return layered

    return make


def torch_symbolic(opset: int, name: str) -> Callable[[], SymbolicFn]:
    """PyTorch's own symbolic ``name`` of ``symbolic_opset<opset>``, looked up when first needed."""

    def fallback() -> SymbolicFn:
        fn: SymbolicFn = getattr(symbolic_opset(opset), name)
        return fn

    return fallback


@contextlib.contextmanager
def symbolics_applied(table: dict[str, SymbolicEntry], opset: int) -> Iterator[None]:
    """Install ``table`` (:func:`symbolic_table`) into torch.onnx for the duration of one export.

    torch.onnx's symbolic registry and its export state are process-wide, so TorchScript
    exports run one at a time: the lock is held until the export ends."""
    with _LOCK:
        entries = [e for e in table.values() if e.opset <= opset]
        installed = []
        try:
            # Installed at the export's own opset: torch picks the newest registration at or
            # below it, and its defaults for some ops (max/min at 18, gelu at 20) sit above ours.
            for entry in entries:
                torch.onnx.register_custom_op_symbolic(entry.op, entry.fn, opset)
                installed.append(entry)
            yield
        finally:
            for entry in installed:
                torch.onnx.unregister_custom_op_symbolic(entry.op, opset)
