"""The Functions this process exported as PythonOp, and the node that calls one.

Run time only ever calls what :data:`REGISTRY` holds: the runner resolves a node's ``func_name``
here and nothing else, and :func:`~ortmodule_exporter.python_op.checks.check_model` refuses a
model naming anything outside it. :func:`python_op_node` builds a PythonOp in a graph pass (the
density flag, Triton kernels, ATen operators without a gradient) and records it here.

>>> from ortmodule_exporter.python_op.registry import REGISTRY, register_python_op_exporter
>>> REGISTRY.sizes()["functions"] >= 0
True
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch

from ..engine_binding import _C
from ..errors import ExportError
from ..onnx_graph import attribute

PYTHON_OP_DOMAIN = "com.microsoft"


class RefusedPythonOpError(ExportError):
    """A model names a Function (or an object reference) this process did not export."""


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# -- the registry of what this process exported ------------------------------------------------


@dataclass
class FunctionEntry:
    """One exported Function: its class and how its tensors cross the boundary."""

    name: str
    cls: type
    #: argument positions that were bool tensors in some export (they arrive as uint8)
    bool_inputs: set[int] = field(default_factory=set)


class FunctionRegistry:
    """The Functions and the by-reference arguments that our export put in a PythonOp.

    Run time only ever calls what is here: the runner resolves ``func_name`` in this registry and
    nothing else, and :func:`check_model` refuses a model that names anything outside it.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._by_name: dict[str, FunctionEntry] = {}
        self._name_of: dict[type, str] = {}
        self._objects: dict[int, Any] = {}
        self._nodes: set[tuple[str, tuple[int, ...]]] = set()

    def register(self, cls: type, name: str | None = None) -> FunctionEntry:
        """The entry for ``cls``, created on first sight. Two different classes with one
        qualified name (a class redefined in a loop or a test) get ``name``, ``name#2``, ...

        An explicit ``name`` files ``cls`` under exactly that name (a name the engine itself
        recognises); it must not already belong to another class.
        """
        with self._lock:
            if name is not None:
                entry = self._by_name.get(name)
                if entry is None:
                    entry = self._by_name[name] = FunctionEntry(name, cls)
                elif entry.cls is not cls:
                    raise ValueError(f"PythonOp name {name!r} already belongs to {entry.cls!r}")
                return entry
            name = self._name_of.get(cls)
            if name is not None:
                return self._by_name[name]
            base = qualified_name(cls)
            name, n = base, 1
            while name in self._by_name:
                n += 1
                name = f"{base}#{n}"
            entry = FunctionEntry(name, cls)
            self._by_name[name] = entry
            self._name_of[cls] = name
            return entry

    def keep(self, obj: Any) -> int:
        """Hold ``obj`` for the life of the process; its id is what the node carries."""
        with self._lock:
            self._objects[id(obj)] = obj
            return id(obj)

    def record_node(self, func_name: str, pointers: Sequence[int]) -> None:
        with self._lock:
            self._nodes.add((func_name, tuple(pointers)))

    def lookup(self, func_name: str) -> FunctionEntry:
        with self._lock:
            entry = self._by_name.get(func_name)
        if entry is None:
            raise RefusedPythonOpError(
                f"PythonOp refused: the model asks to run {func_name!r}, which ORTModule did not "
                "export in this process. A PythonOp may only call torch.autograd.Function classes "
                "exported by this process; names in a model file are never imported."
            )
        return entry

    def knows_node(self, func_name: str, pointers: Sequence[int]) -> bool:
        with self._lock:
            return (func_name, tuple(pointers)) in self._nodes

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

    def sizes(self) -> dict[str, int]:
        """Entry counts, for leak checks: functions, kept objects, exported nodes."""
        with self._lock:
            return {
                "functions": len(self._by_name),
                "objects": len(self._objects),
                "nodes": len(self._nodes),
            }


REGISTRY = FunctionRegistry()

# -- special exporters (other packages: QLoRA's MatMul4Bit, ...) ---------------------------------

_SPECIAL: dict[str, Callable[..., Any]] = {}


def register_python_op_exporter(func_name: str, handler: Callable[..., Any]) -> None:
    """Export calls of the Function named ``func_name`` with ``handler(g, node, *args)`` first.

    The handler returns the ONNX values replacing the call, or ``None`` to fall back to the
    generic PythonOp export.

    >>> register_python_op_exporter("bitsandbytes.autograd._functions.MatMul4Bit", lambda g, n, *a: None)
    """
    _SPECIAL[func_name] = handler


def python_op_exporters() -> dict[str, Callable[..., Any]]:
    """The registered Function exporters (``func_name -> handler``), for export-cache keys."""
    return dict(_SPECIAL)


class _EngineStub(torch.autograd.Function):
    """What the engine's own function pool holds for every exported name.

    The engine insists on a direct ``torch.autograd.Function`` subclass per ``func_name`` and
    passes it back to our runner, which ignores it and resolves the name in :data:`REGISTRY`.
    So the engine never holds user classes, and subclasses of subclasses export too.
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:  # pragma: no cover - never called
        raise RuntimeError(
            "ORTModule's PythonOp runner calls the registered Function, not this stub"
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never called
        raise RuntimeError(
            "ORTModule's PythonOp runner calls the registered Function, not this stub"
        )


def _register_with_engine(name: str) -> None:
    try:
        C = _C()
    except ImportError:  # pragma: no cover - exporting without the engine installed
        return
    C.register_torch_autograd_function(name, _EngineStub)


def python_op_node(
    entry: FunctionEntry,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    name: str,
    convention: str,
    types: tuple[Sequence[int], Sequence[int]],
    ranks: tuple[Sequence[int], Sequence[int]],
    training: bool,
    scalars: Mapping[str, tuple[Sequence[int], Sequence[int]]] | None = None,
    comment: str = "",
) -> onnx.NodeProto:
    """A ``PythonOp`` node, built in a graph pass, that calls ``entry``'s Function.

    ``outputs`` starts with the context output; ``types`` and ``ranks`` are (inputs, outputs) of
    the tensor arguments; ``scalars`` maps a kind (``"int"``, ``"pointer"``) to its (values,
    argument positions). The node is recorded in :data:`REGISTRY` and its name given to the
    engine, so the runner accepts it.
    """
    scalars = scalars or {}
    pointers = list(scalars.get("pointer", ((), ()))[0])
    REGISTRY.record_node(entry.name, pointers)
    _register_with_engine(entry.name)
    attrs: dict[str, Any] = {}
    for kind, (values, positions) in scalars.items():
        attrs[f"input_{kind}_scalars"] = list(values)
        attrs[f"input_{kind}_scalar_positions"] = list(positions)
    return onnx.helper.make_node(
        "PythonOp",
        list(inputs),
        list(outputs),
        name=name,
        domain=PYTHON_OP_DOMAIN,
        func_name=entry.name,
        input_convention=convention,
        input_tensor_types=list(types[0]),
        input_tensor_ranks=list(ranks[0]),
        output_tensor_types=list(types[1]),
        output_tensor_ranks=list(ranks[1]),
        training_mode=int(training),
        safe_run_mode=1,
        comment=comment,
        **attrs,
    )


def _func_name(node: onnx.NodeProto) -> str:
    value = attribute(node, "func_name")
    if value is None:
        value = attribute(node, "name")  # the attribute's name in older engines
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value or "")
