"""Export every ``torch.autograd.Function`` called in forward as one ``com.microsoft::PythonOp``.

The engine keeps the node opaque: its forward and backward run the Function's own ``forward``
and ``backward`` in PyTorch (see :mod:`ortmodule_exporter.python_op_runner`), on the engine's
tensors, so any Function trains under ORTModule, including ones wrapping operators ONNX cannot
express.

>>> from ortmodule_exporter.python_op import enable_custom_autograd, register_shape_inference
>>> enable_custom_autograd(True)                       # what ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1 does
>>> register_shape_inference("my_pkg.ops.Gelu", lambda shapes, dtypes: [shapes[0]])

What the exported node carries (the attributes the engine's PythonOp kernels read):

* ``func_name``: the Function's fully qualified name (``module.QualName``), the key the runner
  looks up in :data:`REGISTRY` at run time;
* ``input_convention``: one letter per ``apply`` argument, ``d`` for a tensor (a node input),
  ``c`` for anything else;
* non-tensor arguments by kind: bool, int and float scalars and tuples of them are stored in the
  node (``input_*_scalars``/``input_*_tuples`` with their positions); floats that float32 cannot
  hold exactly, lists, strings, ``None`` and every other object are passed by reference
  (``input_pointer_scalars``), kept alive by :data:`REGISTRY`;
* ``input_tensor_types``/``ranks``, ``output_tensor_types``/``ranks``, ``training_mode``.

Output 0 of the node is the autograd context the backward node receives; outputs 1.. are the
Function's outputs. Bool tensors cross the engine boundary as uint8 (the engine's DLPack import
has no bool), so a bool output is declared uint8 and cast back right after the node.

Security: a PythonOp can only run a Function that this process exported (see
:func:`check_model`); a model loaded from a file or the export cache that names anything else is
refused, and no name from a model file is ever imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import struct
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch

from .engine_binding import _C
from .errors import ExportError
from .onnx_graph import attribute
from .post_export import register_post_export_pass
from .symbolic_registry import register_symbolic, unregister_symbolic

__all__ = [
    "CHECKPOINT_FUNCTIONS",
    "PYTHON_OP_DOMAIN",
    "REGISTRY",
    "CheckpointExportError",
    "FunctionRegistry",
    "RefusedPythonOpError",
    "ShapeFn",
    "allow_autograd_checkpoint",
    "check_model",
    "custom_autograd_enabled",
    "enable_custom_autograd",
    "python_op_exporters",
    "export_settings",
    "exporting_copy_of",
    "model_is_runnable",
    "qualified_name",
    "register_python_op_exporter",
    "register_shape_inference",
    "unregister_shape_inference",
]

logger = logging.getLogger("ortmodule.exporter")

PYTHON_OP_DOMAIN = "com.microsoft"
_SYMBOLIC = "prim::PythonOp"

#: Functions that recompute a whole region in backward (activation checkpointing)
CHECKPOINT_FUNCTIONS = frozenset(
    {
        "torch.utils.checkpoint.CheckpointFunction",
        "deepspeed.checkpointing.CheckpointFunction",
        "deepspeed.runtime.activation_checkpointing.checkpointing.CheckpointFunction",
    }
)

#: ``fn(input_shapes, input_dtypes) -> output_shapes``: shapes are lists of ``int`` (static),
#: ``str`` (a symbolic dim) or ``None`` (unknown), one per tensor input/output; dtypes are ONNX
#: element types. A shape may itself be ``None`` when the input's rank is unknown.
ShapeFn = Callable[
    [list[list[int | str | None] | None], list[int]], Sequence[Sequence[int | str | None] | None]
]


class RefusedPythonOpError(ExportError):
    """A model names a Function (or an object reference) this process did not export."""


class CheckpointExportError(ExportError):
    """A checkpointed region (``torch.utils.checkpoint``) was met while exporting."""


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


# -- switches ----------------------------------------------------------------------------------


@dataclass
class _Switches:
    enabled: bool = False
    allow_checkpoint: bool = False


_SWITCHES = _Switches()


def enable_custom_autograd(enabled: bool = True, allow_checkpoint: bool = False) -> None:
    """Export ``torch.autograd.Function`` calls as PythonOp (``enabled``) or inline their forward.

    ``allow_checkpoint`` lets ``torch.utils.checkpoint`` regions through as PythonOp (they then
    run in PyTorch); without it they are refused at export with an explanation.

    >>> enable_custom_autograd(False)   # inline every Function's forward into the ONNX graph
    >>> enable_custom_autograd(True)
    """
    _SWITCHES.enabled = bool(enabled)
    _SWITCHES.allow_checkpoint = bool(allow_checkpoint)
    if enabled:
        register_symbolic(_SYMBOLIC, _python_op_symbolic, 1)
    else:
        unregister_symbolic(_SYMBOLIC)


def custom_autograd_enabled() -> bool:
    return _SWITCHES.enabled


def allow_autograd_checkpoint() -> bool:
    return _SWITCHES.allow_checkpoint


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


# -- shape inference ---------------------------------------------------------------------------

_SHAPE_FNS: dict[str, ShapeFn] = {}
_SHAPE_FNS_BY_CLASS: dict[type, ShapeFn] = {}


def register_shape_inference(func: str | type, fn: ShapeFn) -> None:
    """Give a Function's PythonOp outputs real dims instead of rank-only unknown ones.

    ``func`` is the Function class or its qualified name. ``fn(input_shapes, input_dtypes)``
    returns one shape per tensor output (see :data:`ShapeFn`); dims that are strings are the
    model's symbolic dims, so a pass-through keeps ``batch`` and ``seq`` known downstream.

    >>> register_shape_inference("my_pkg.ops.ScaledGelu", lambda shapes, dtypes: [shapes[0]])
    """
    if not callable(fn):
        raise TypeError("register_shape_inference: fn must be callable")
    if isinstance(func, str):
        _SHAPE_FNS[func] = fn
    else:
        _SHAPE_FNS_BY_CLASS[func] = fn


def unregister_shape_inference(func: str | type) -> None:
    if isinstance(func, str):
        _SHAPE_FNS.pop(func, None)
    else:
        _SHAPE_FNS_BY_CLASS.pop(func, None)


def _shape_fn(func_name: str) -> ShapeFn | None:
    try:
        entry = REGISTRY.lookup(func_name)
    except RefusedPythonOpError:
        return _SHAPE_FNS.get(func_name)
    fn = _SHAPE_FNS_BY_CLASS.get(entry.cls)
    return fn if fn is not None else _SHAPE_FNS.get(qualified_name(entry.cls))


# -- the module copy that export traces --------------------------------------------------------

_ORIGINALS: contextvars.ContextVar[dict[int, torch.nn.Module] | None] = contextvars.ContextVar(
    "ortmodule_export_originals", default=None
)


@contextlib.contextmanager
def exporting_copy_of(original: torch.nn.Module, copy: torch.nn.Module) -> Iterator[None]:
    """While ``copy`` (a deep copy of ``original``) is traced, hand Functions the originals.

    A Function given a module or a bound method by reference (``checkpoint(self.block, x)``)
    would otherwise keep the copy made for export and train the copy's parameters.

    >>> m = torch.nn.Linear(2, 2)
    >>> with exporting_copy_of(m, m):
    ...     pass
    """
    mapping: dict[int, torch.nn.Module] = {}
    if copy is not original:
        originals = dict(original.named_modules(remove_duplicate=False))
        for name, module in copy.named_modules(remove_duplicate=False):
            match = originals.get(name)
            if match is not None and type(match) is type(module):
                mapping[id(module)] = match
    token = _ORIGINALS.set(mapping)
    try:
        yield
    finally:
        _ORIGINALS.reset(token)


def _original(obj: Any) -> Any:
    mapping = _ORIGINALS.get()
    if not mapping:
        return obj
    if isinstance(obj, torch.nn.Module):
        return mapping.get(id(obj), obj)
    if isinstance(obj, types.MethodType) and isinstance(obj.__self__, torch.nn.Module):
        owner = mapping.get(id(obj.__self__))
        if owner is not None:
            return types.MethodType(obj.__func__, owner)
    return obj


# -- the symbolic -------------------------------------------------------------------------------

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT8 = int(onnx.TensorProto.UINT8)
_BOOL = int(onnx.TensorProto.BOOL)
_INT64 = int(onnx.TensorProto.INT64)


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


def _float32_exact(value: float) -> bool:
    try:
        return bool(struct.unpack("f", struct.pack("f", value))[0] == value)
    except (OverflowError, struct.error):
        return False


def _is_int64(value: int) -> bool:
    return _INT64_MIN <= value <= _INT64_MAX


@dataclass
class _Encoded:
    attrs: dict[str, Any] = field(default_factory=dict)
    pointers: list[int] = field(default_factory=list)
    pointer_positions: list[int] = field(default_factory=list)

    def add(self, kind: str, position: int, value: Any) -> None:
        self.attrs.setdefault(f"input_{kind}_scalars", []).append(value)
        self.attrs.setdefault(f"input_{kind}_scalar_positions", []).append(position)

    def add_tuple(self, kind: str, position: int, values: list[Any]) -> None:
        flat = self.attrs.setdefault(f"input_{kind}_tuples", [])
        self.attrs.setdefault(f"input_{kind}_tuple_begins", []).append(len(flat))
        self.attrs.setdefault(f"input_{kind}_tuple_positions", []).append(position)
        flat.extend(values)


def _encode_constant(enc: _Encoded, position: int, value: Any, func_name: str) -> None:
    """One non-tensor argument, in the node when the engine can rebuild it exactly, else by reference."""
    if isinstance(value, bool):
        enc.add("bool", position, int(value))
        return
    if isinstance(value, int) and _is_int64(value):
        enc.add("int", position, value)
        return
    if isinstance(value, float) and _float32_exact(value):
        enc.add("float", position, value)
        return
    if isinstance(value, tuple) and value:
        if all(isinstance(v, bool) for v in value):
            enc.add_tuple("bool", position, [int(v) for v in value])
            return
        if all(isinstance(v, int) and not isinstance(v, bool) and _is_int64(v) for v in value):
            enc.add_tuple("int", position, list(value))
            return
        if all(isinstance(v, float) and _float32_exact(v) for v in value):
            enc.add_tuple("float", position, list(value))
            return
    if _holds_tensor(value):
        warnings.warn(
            f"ORTModule: argument {position} of {func_name} holds tensors inside a container; "
            "it is passed by reference as seen during export, so later values of those tensors "
            "are not fed by the model. Pass tensors as direct arguments of apply().",
            stacklevel=2,
        )
    value = _original(value)
    enc.pointers.append(REGISTRY.keep(value))
    enc.pointer_positions.append(position)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) or _holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) or _holds_tensor(v) for v in value.values())
    return False


def _onnx_type(value_type: Any) -> int | None:
    from torch.onnx._internal.torchscript_exporter import _type_utils

    name = value_type.scalarType() if hasattr(value_type, "scalarType") else None
    if name is None:
        return None
    onnx_type: Any = _type_utils.JitScalarType._from_name(name).onnx_type()
    return int(onnx_type)


def _training_mode() -> bool:
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    return bool(GLOBALS.training_mode == torch.onnx.TrainingMode.TRAINING)


def _checkpoint_message(name: str) -> str:
    return (
        f"ORTModule does not export activation checkpointing ({name}, from "
        "torch.utils.checkpoint with use_reentrant=True): as a PythonOp the whole checkpointed "
        "region would run in PyTorch, outside ONNX Runtime, on every step, and ONNX Runtime could "
        "not optimise it. Instead, remove the checkpoint calls and let ONNX Runtime's memory "
        "optimizer recompute activations (ORTMODULE_MEMORY_OPT_LEVEL=1 recomputes every "
        "transformer layer; ORTMODULE_MEMORY_OPT_CONFIG picks subgraphs). To run the checkpointed "
        "regions in PyTorch anyway, set ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1."
    )


def _python_op_symbolic(g: Any, *args: Any, **_kwargs: Any) -> Any:
    node = g.original_node
    cls = node.pyobj().__self__
    qual = qualified_name(cls)
    special = _SPECIAL.get(qual)
    if special is not None:
        result = special(g, node, *args)
        if result is not None:
            return result
    if qual in CHECKPOINT_FUNCTIONS and not _SWITCHES.allow_checkpoint:
        raise CheckpointExportError(_checkpoint_message(qual), op=qual)

    entry = REGISTRY.register(cls)
    cconv = node.cconv()
    if len(cconv) != len(args):
        raise ExportError(
            f"PythonOp export of {entry.name}: {len(args)} arguments for convention {cconv!r}"
        )

    enc = _Encoded()
    tensors: list[Any] = []
    input_types: list[int] = []
    input_ranks: list[int] = []
    for position, (arg, kind) in enumerate(zip(args, cconv, strict=True)):
        if kind == "d":
            onnx_type = _onnx_type(arg.type())
            if onnx_type is None:
                raise ExportError(
                    f"PythonOp export of {entry.name}: tensor argument {position} has no known dtype"
                )
            if onnx_type == _BOOL:
                entry.bool_inputs.add(position)
            tensors.append(arg)
            input_types.append(onnx_type)
            input_ranks.append(arg.type().dim() or 0)
        elif kind == "c":
            _encode_constant(enc, position, arg, entry.name)
        else:
            raise ExportError(
                f"PythonOp export of {entry.name}: unknown argument convention {kind!r}"
            )

    outputs = list(node.outputs())
    output_types: list[int] = []
    output_ranks: list[int] = []
    for out in outputs:
        onnx_type = _onnx_type(out.type())
        if onnx_type is None:  # a non-tensor output: a placeholder the runner leaves empty
            output_types.append(_INT64)
            output_ranks.append(0)
            continue
        output_types.append(_UINT8 if onnx_type == _BOOL else onnx_type)
        output_ranks.append(out.type().dim() or 0)

    attrs: dict[str, Any] = {
        "func_name_s": entry.name,
        "input_convention_s": cconv,
        "input_tensor_types_i": input_types,
        "input_tensor_ranks_i": input_ranks,
        "output_tensor_types_i": output_types,
        "output_tensor_ranks_i": output_ranks,
        "training_mode_i": int(_training_mode()),
        "safe_run_mode_i": 1,
        "comment_s": "",
    }
    for key, value in enc.attrs.items():
        suffix = "f" if key in ("input_float_scalars", "input_float_tuples") else "i"
        attrs[f"{key}_{suffix}"] = value
    if enc.pointers:
        attrs["input_pointer_scalars_i"] = enc.pointers
        attrs["input_pointer_scalar_positions_i"] = enc.pointer_positions
    REGISTRY.record_node(entry.name, enc.pointers)
    _register_with_engine(entry.name)

    values = g.op(f"{PYTHON_OP_DOMAIN}::PythonOp", *tensors, outputs=1 + len(outputs), **attrs)
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    values[0].setType(torch._C.TensorType.create_from_tensor(torch.zeros((), dtype=torch.int64)))
    results = []
    for value, out, onnx_type in zip(values[1:], outputs, output_types, strict=True):
        out_type = out.type()
        rank = out_type.dim() if hasattr(out_type, "dim") else None
        if _onnx_type(out_type) is None:
            value.setType(
                torch._C.TensorType.create_from_tensor(torch.zeros((), dtype=torch.int64))
            )
            results.append(value)
            continue
        unknown = [None] * rank if rank is not None else None
        if onnx_type == _UINT8 and _onnx_type(out_type) == _BOOL:
            value.setType(
                out_type.with_dtype(torch.uint8).with_sizes(unknown)
                if unknown is not None
                else out_type.with_dtype(torch.uint8)
            )
            cast = g.op("Cast", value, to_i=_BOOL)
            cast.setType(out_type.with_sizes(unknown) if unknown is not None else out_type)
            results.append(cast)
            continue
        value.setType(out_type.with_sizes(unknown) if unknown is not None else out_type)
        results.append(value)
    return results[0] if len(results) == 1 else tuple(results)


# -- checks and passes on exported models -------------------------------------------------------


def _python_op_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        if node.domain == PYTHON_OP_DOMAIN and node.op_type in ("PythonOp", "PythonOpGrad"):
            yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _python_op_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    yield from _python_op_nodes(sub)


def _func_name(node: onnx.NodeProto) -> str:
    value = attribute(node, "func_name")
    if value is None:
        value = attribute(node, "name")  # the attribute's name in older engines
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value or "")


def check_model(model: onnx.ModelProto) -> None:
    """Refuse a model with a PythonOp that this process did not export.

    Every PythonOp must name a Function registered by our export in this process and carry only
    the object references that export produced. Raises :class:`RefusedPythonOpError` otherwise.
    """
    for node in _python_op_nodes(model.graph):
        name = _func_name(node)
        REGISTRY.lookup(name)
        pointers = list(attribute(node, "input_pointer_scalars") or [])
        if node.op_type == "PythonOp" and not REGISTRY.knows_node(name, pointers):
            raise RefusedPythonOpError(
                f"PythonOp refused: node {node.name!r} calls {name} with object references "
                "that ORTModule did not export in this process (a model from a file or from the "
                "export cache of another run). Re-export the module, or clear ORTMODULE_CACHE_DIR."
            )


def model_is_runnable(model: onnx.ModelProto) -> bool:
    """Whether :func:`check_model` accepts ``model`` (a cache hit that fails is a miss)."""
    try:
        check_model(model)
    except RefusedPythonOpError:
        return False
    return True


def export_settings() -> str:
    """The switches that change what the export writes, for export-cache keys."""
    return f"custom_autograd={int(_SWITCHES.enabled)},checkpoint={int(_SWITCHES.allow_checkpoint)}"


def _check_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    check_model(exported.model)


def _dims(vi: onnx.ValueInfoProto | None) -> list[int | str | None] | None:
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _set_value_info(
    graph: onnx.GraphProto, name: str, elem_type: int, dims: Sequence[int | str | None]
) -> None:
    for vi in list(graph.value_info):
        if vi.name == name:
            graph.value_info.remove(vi)
    shape = [d if d is not None else None for d in dims]
    graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, shape))


def infer_python_op_shapes(model: onnx.ModelProto) -> int:
    """Write the output dims of every PythonOp whose Function has a shape function.

    Returns how many nodes got dims. Without a shape function an output keeps its rank only.
    """
    graph = model.graph
    todo = [n for n in graph.node if n.domain == PYTHON_OP_DOMAIN and n.op_type == "PythonOp"]
    todo = [(n, fn) for n in todo if (fn := _shape_fn(_func_name(n))) is not None]
    done = 0
    for node, fn in todo:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # noqa: BLE001 - shapes are an optimisation, never a failed export
            return done
        known = {
            vi.name: vi
            for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
        }
        in_shapes = [_dims(known.get(name)) for name in node.input]
        in_types = list(attribute(node, "input_tensor_types") or [])
        out_types = list(attribute(node, "output_tensor_types") or [])
        try:
            shapes = list(fn(in_shapes, in_types))
        except Exception as err:  # noqa: BLE001
            logger.warning(
                "shape function of %s failed (%s); its outputs keep their rank only",
                _func_name(node),
                err,
            )
            continue
        for name, shape, elem_type in zip(node.output[1:], shapes, out_types, strict=False):
            if shape is not None and name:
                _set_value_info(graph, name, elem_type, shape)
        done += 1
    return done


def _shape_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    infer_python_op_shapes(exported.model)


register_post_export_pass("python_op_check", _check_pass, order=0)
register_post_export_pass("python_op_shapes", _shape_pass, order=20)
