"""Our registry of ONNX symbolic functions, applied only while ORTModule exports.

A symbolic turns one ATen operator into ONNX nodes during the TorchScript export. We register
ours for the duration of an export and remove them afterwards, so a user's own
``torch.onnx.export`` calls elsewhere in the process see PyTorch's defaults.

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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

SymbolicFn = Callable[..., Any]


@dataclass(frozen=True)
class SymbolicEntry:
    op: str
    fn: SymbolicFn
    opset: int


_REGISTRY: dict[str, SymbolicEntry] = {}
_LOCK = threading.RLock()


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


def unregister_symbolic(op: str) -> None:
    with _LOCK:
        _REGISTRY.pop(_qualify(op), None)


def registered_symbolics() -> dict[str, SymbolicEntry]:
    with _LOCK:
        return dict(_REGISTRY)


@contextlib.contextmanager
def symbolics_applied(opset: int) -> Iterator[None]:
    """Install every registered symbolic into torch.onnx for the duration of one export."""
    with _LOCK:
        entries = [e for e in _REGISTRY.values() if e.opset <= opset]
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
