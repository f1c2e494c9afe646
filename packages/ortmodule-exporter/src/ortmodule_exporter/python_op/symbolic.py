"""Export every ``torch.autograd.Function`` called in forward as one ``com.microsoft::PythonOp``.

The engine keeps the node opaque: its forward and backward run the Function's own ``forward``
and ``backward`` in PyTorch (see :mod:`ortmodule_exporter.python_op.runner`), on the engine's
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
:func:`~ortmodule_exporter.python_op.checks.check_model`); a model loaded from a file or the
export cache that names anything else is refused, and no name from a model file is ever imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import struct
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch

from ..active_export import active_export_config
from ..errors import ExportError
from ..symbolics.registry import LayerSymbolic, register_symbolic_layer
from ..torchscript_onnx import GLOBALS, type_utils
from .registry import _SPECIAL, PYTHON_OP_DOMAIN, REGISTRY, _register_with_engine, qualified_name

logger = logging.getLogger("ortmodule.exporter")

_SYMBOLIC = "prim::PythonOp"

#: Functions that recompute a whole region in backward (activation checkpointing)
CHECKPOINT_FUNCTIONS = frozenset(
    {
        "torch.utils.checkpoint.CheckpointFunction",
        "deepspeed.checkpointing.CheckpointFunction",
        "deepspeed.runtime.activation_checkpointing.checkpointing.CheckpointFunction",
    }
)


class CheckpointExportError(ExportError):
    """A checkpointed region (``torch.utils.checkpoint``) was met while exporting."""


# -- switches ----------------------------------------------------------------------------------


@dataclass
class _Switches:
    enabled: bool = False
    allow_checkpoint: bool = False


#: the process defaults, which an export without a config uses (``ExportConfig.from_switches``)
_SWITCHES = _Switches()


def enable_custom_autograd(enabled: bool = True, allow_checkpoint: bool = False) -> None:
    """Export ``torch.autograd.Function`` calls as PythonOp (``enabled``) or inline their forward.

    ``allow_checkpoint`` lets ``torch.utils.checkpoint`` regions through as PythonOp (they then
    run in PyTorch); without it they are refused at export with an explanation. These are the
    process defaults: an export given an ``ExportConfig`` (ORTModule's always are) uses its own
    ``custom_autograd`` and ``allow_autograd_checkpoint`` instead.

    >>> enable_custom_autograd(False)   # inline every Function's forward into the ONNX graph
    >>> enable_custom_autograd(True)
    """
    _SWITCHES.enabled = bool(enabled)
    _SWITCHES.allow_checkpoint = bool(allow_checkpoint)


def custom_autograd_enabled() -> bool:
    """Whether the export running in this context (else the process default) makes PythonOps."""
    active = active_export_config()
    return _SWITCHES.enabled if active is None else bool(active.custom_autograd)


def allow_autograd_checkpoint() -> bool:
    active = active_export_config()
    return _SWITCHES.allow_checkpoint if active is None else bool(active.allow_autograd_checkpoint)


def _python_op_layer(config: Any) -> Iterator[LayerSymbolic]:
    if config.custom_autograd:
        yield LayerSymbolic(_SYMBOLIC, lambda below: _python_op_symbolic, 1)


register_symbolic_layer("python_op", _python_op_layer, order=10)


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

    name = value_type.scalarType() if hasattr(value_type, "scalarType") else None
    if name is None:
        return None
    onnx_type: Any = type_utils.JitScalarType._from_name(name).onnx_type()
    return int(onnx_type)


def _training_mode() -> bool:

    # the export keeps each submodule's own mode (TrainingMode.PRESERVE); export_training says
    # whether the module as a whole trains
    return bool(GLOBALS.export_training)


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
    if qual in CHECKPOINT_FUNCTIONS and not allow_autograd_checkpoint():
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
