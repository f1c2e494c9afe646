"""Run the engine's ``org.pytorch.aten::ATen`` nodes with PyTorch's own operators.

An ATen node names a PyTorch operator (``operator`` and ``overload_name`` attributes) instead of
ONNX ops; the engine hands its tensors to the executor registered with
``register_aten_op_executor`` and takes the results back, both as ``DLManagedTensor*``. Our
executor is two ``ctypes`` callbacks, nothing compiled:

* ``is_tensor_argument(op, overload, index, is_input) -> bool``: whether the operator's argument
  (or return) ``index`` is a tensor;
* ``execute(op, overload, n_in, DLManagedTensor** in, n_out, DLManagedTensor** out)``: inputs
  are owned by the executor (missing optional ones are null); outputs are handed to the engine.

Non-tensor arguments (ints, floats, bools, lists of them, dtypes) reach the executor as small
tensors; the operator's schema says how to read each one back.

>>> from ortmodule_exporter.aten import executor as aten_executor
>>> aten_executor.install()         # once per process; ORTModule does it for you

Besides ``aten::`` operators the executor runs a few of our own (:func:`register_aten_function`),
such as the generic backward ``_ortmodule_vjp`` used for operators without a gradient formula.
Custom operators (``torch.library.custom_op``, named ``ns::op``: the ``torch_export``
frontend's ATen route writes them) run too, and train through their registered autograd.
Nothing is ever imported by name: a name resolves in ``torch.ops`` among the operators this
process registered.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import dlpack_bridge as bridge
from ..callback_errors import remember
from ..engine_binding import _C
from ..torchscript_onnx import type_utils
from . import parallel

__all__ = [
    "ATEN_DOMAIN",
    "AtenFunction",
    "UnsupportedAtenOperatorError",
    "call_count",
    "execute",
    "install",
    "installed",
    "is_tensor_argument",
    "register_aten_function",
]

logger = logging.getLogger("ortmodule.exporter")

ATEN_DOMAIN = "org.pytorch.aten"


class UnsupportedAtenOperatorError(RuntimeError):
    """An ATen node names an operator the executor does not run."""


# -- our own operators --------------------------------------------------------------------------


@dataclass(frozen=True)
class AtenFunction:
    """An operator of ours the executor runs: ``fn(overload_name, inputs) -> outputs``.

    ``inputs`` are tensors or None, ``outputs`` tensors or None; ``is_tensor(overload, index,
    is_input)`` answers the engine's question about argument kinds.
    """

    fn: Callable[[str, list[torch.Tensor | None]], Sequence[torch.Tensor | None]]
    is_tensor: Callable[[str, int, bool], bool]


_FUNCTIONS: dict[str, AtenFunction] = {}


def register_aten_function(name: str, fn: AtenFunction) -> None:
    """Let ATen nodes with ``operator=name`` run ``fn``; ``name`` must not be an aten name.

    >>> register_aten_function("_ortmodule_identity",
    ...     AtenFunction(lambda overload, xs: xs, lambda overload, i, is_input: True))
    """
    if not name.startswith("_ortmodule"):
        raise ValueError(f"our ATen functions are named _ortmodule*, got {name!r}")
    _FUNCTIONS[name] = fn


# -- aten operators -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Arg:
    name: str
    kind: str  # Tensor, int, float, bool, Scalar, ScalarType, int[], float[], bool[], other
    optional: bool
    has_default: bool
    default: Any
    kwarg_only: bool = False


@dataclass(frozen=True)
class AtenOperator:
    """A resolved ``torch.ops.aten`` overload and how to read its arguments from tensors."""

    op: Any
    args: tuple[_Arg, ...]
    returns: tuple[str, ...]
    overload: str = ""  # the resolved overload name, "" for default

    @property
    def tensor_inputs(self) -> list[int]:
        return [i for i, a in enumerate(self.args) if a.kind == "Tensor"]


def _kind(jit_type: Any) -> tuple[str, bool]:
    optional = False
    if jit_type.kind() == "OptionalType":
        optional = True
        jit_type = jit_type.getElementType()
    kind = jit_type.kind()
    if kind == "ListType":
        element = jit_type.getElementType().kind()
        names = {
            "IntType": "int[]",
            "SymIntType": "int[]",
            "FloatType": "float[]",
            "BoolType": "bool[]",
            "TensorType": "Tensor[]",
        }
        return names.get(element, "other"), optional
    names = {
        "TensorType": "Tensor",
        "IntType": "int",
        "SymIntType": "int",
        "FloatType": "float",
        "BoolType": "bool",
        "NumberType": "Scalar",
        "ScalarTypeType": "ScalarType",
        "StringType": "str",  # reaches the executor through a PythonOp (AtenOp) only
    }
    return names.get(kind, "other"), optional


#: namespaces of PyTorch's own operators: ``aten`` runs; ``prim``/``prims`` (TorchScript's and
#: the decompositions' primitives) never name an ATen node
_BUILTIN_NAMESPACES = frozenset({"aten", "prim", "prims"})


@functools.lru_cache(maxsize=1024)
def aten_operator(op_name: str, overload_name: str, n_inputs: int = -1) -> AtenOperator:
    """Resolve ``aten::op_name.overload_name`` (``op_name`` without a namespace is aten's), or
    ``ns::op_name.overload_name``, a custom operator (``torch.library.custom_op``) that is
    registered in this process: ``torch.ops.<ns>`` holds only registered operators, so nothing
    is imported by name. An empty overload name (what the exporter
    writes when it does not know it) picks ``default`` when it takes ``n_inputs`` arguments,
    else the overload that does (``Tensor`` first, then ``Scalar``; ``out`` variants aside)."""
    namespace, _, name = op_name.rpartition("::")
    namespace = namespace or "aten"
    if namespace in _BUILTIN_NAMESPACES - {"aten"}:
        raise UnsupportedAtenOperatorError(
            f"ATen node names {op_name!r}; only aten:: and custom operators run"
        )
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        raise UnsupportedAtenOperatorError(f"PyTorch has no operator {namespace}::{name}") from None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise UnsupportedAtenOperatorError(f"{namespace}::{name} is not an operator")
    overloads = list(packet.overloads())

    def takes(o: str) -> bool:
        return n_inputs < 0 or len(getattr(packet, o)._schema.arguments) == n_inputs

    if overload_name:
        if overload_name not in overloads:
            raise UnsupportedAtenOperatorError(
                f"{namespace}::{name} has no overload {overload_name!r} ({overloads})"
            )
        chosen = overload_name
    elif "default" in overloads and takes("default"):
        chosen = "default"
    else:
        fitting = [
            o for o in overloads if takes(o) and not o.startswith("out") and not o.endswith("_out")
        ]
        if not fitting:
            raise UnsupportedAtenOperatorError(
                f"{namespace}::{name}: no overload takes {n_inputs} arguments (it has {overloads})"
            )
        # scalars reach the executor as tensors: a Tensor overload takes them as they are
        fitting.sort(key=lambda o: (o != "Tensor", o != "Scalar", o))
        chosen = fitting[0]
    op = getattr(packet, chosen)
    args = []
    for a in op._schema.arguments:
        # a custom operator's ScalarType argument has the JIT type int (its real type says
        # ScalarType): read it as a dtype, which its Python kernel expects (aten's take the int)
        kind, optional = _kind(a.type if namespace == "aten" else a.real_type)
        has_default = a.has_default_value()
        default = a.default_value if has_default else None
        args.append(_Arg(a.name, kind, optional, has_default, default, bool(a.kwarg_only)))
    returns = tuple(_kind(r.type)[0] for r in op._schema.returns)
    return AtenOperator(op, tuple(args), returns, "" if chosen == "default" else chosen)


def _scalar_type(code: int) -> torch.dtype:

    return type_utils.JitScalarType(int(code)).dtype()


def _read(arg: _Arg, value: Any, as_bool: bool) -> Any:
    if isinstance(value, (str, list)):
        return value  # a string or a list of tensors, handed over by a PythonOp (AtenOp)
    if value is None:
        if arg.optional or arg.kind == "Tensor":
            return None
        if arg.has_default:
            return arg.default
        raise UnsupportedAtenOperatorError(f"argument {arg.name!r} is missing and has no default")
    if arg.kind == "Tensor":
        return value.view(torch.bool) if as_bool and value.dtype == torch.uint8 else value
    kind = arg.kind
    if kind == "int":
        return int(value.item())
    if kind == "float":
        return float(value.item())
    if kind == "bool":
        return bool(value.item())
    if kind == "Scalar":
        return value.item()
    if kind == "ScalarType":
        return _scalar_type(int(value.item()))
    flat = value.reshape(-1)
    if kind == "int[]":
        return [int(v) for v in flat.tolist()]
    if kind == "float[]":
        return [float(v) for v in flat.tolist()]
    if kind == "bool[]":
        return [bool(v) for v in flat.tolist()]
    raise UnsupportedAtenOperatorError(
        f"argument {arg.name!r} has a type the ATen executor cannot pass"
    )


#: (operator, overload) -> input positions that were bool tensors at export (they arrive as uint8)
BOOL_INPUTS: dict[tuple[str, str], set[int]] = {}


def call_aten(
    op_name: str, overload_name: str, inputs: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Run ``aten::op_name.overload_name`` on the node's inputs (tensors or None)."""
    if overload_name.endswith("_hacked_twin") and any(
        isinstance(v, list) and any(t is None for t in v) for v in inputs
    ):
        # the tracer records index's Tensor[] twin; a list with a None (x[..., i]) needs the
        # Tensor?[] overload it stands for
        overload_name = overload_name.removesuffix("_hacked_twin")
    op = aten_operator(op_name, overload_name, len(inputs))
    if len(inputs) != len(op.args):
        raise UnsupportedAtenOperatorError(
            f"aten::{op_name}.{overload_name or 'default'} takes {len(op.args)} arguments, the node has {len(inputs)}"
        )
    bools = BOOL_INPUTS.get((op_name, overload_name), ())
    positional, keywords = [], {}
    for i, (arg, value) in enumerate(zip(op.args, inputs, strict=True)):
        read = _read(arg, value, i in bools)
        if arg.kwarg_only:  # keyword-only arguments come last in a schema
            keywords[arg.name] = read
        else:
            positional.append(read)
    in_pieces = parallel.row_splitter(op_name)
    if in_pieces is not None:
        result = in_pieces(op.op, positional, keywords)
    else:
        result = op.op(*positional, **keywords)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    return [_as_output(r) for r in results]


def _as_output(value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    raise UnsupportedAtenOperatorError(f"the ATen executor cannot return a {type(value).__name__}")


def returns_list(op_name: str, overload_name: str, n_inputs: int = -1) -> bool:
    """Whether the aten operator returns one list of tensors (``dsplit``, ``unbind``): the
    ATen pass gives such a node one output per element the graph reads."""
    if op_name in _FUNCTIONS:
        return False
    try:
        return aten_operator(op_name, overload_name, n_inputs).returns == ("Tensor[]",)
    except UnsupportedAtenOperatorError:
        return False


def first_elements(
    op_name: str, results: list[torch.Tensor | None], count: int
) -> list[torch.Tensor | None]:
    """The first ``count`` elements of the list ``op_name`` returned: the graph reads none
    after them (it read ``torch.dsplit(x, 2)[0]``, say)."""
    if len(results) < count:
        raise UnsupportedAtenOperatorError(
            f"aten::{op_name} returned {len(results)} tensors, the graph reads {count}: the list "
            "is shorter than when the model was exported"
        )
    return results[:count]


def execute(
    op_name: str, overload_name: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Run one ATen node: our own function when ``op_name`` is one, else the aten operator."""
    own = _FUNCTIONS.get(op_name)
    if own is not None:
        return list(own.fn(overload_name, inputs))
    return call_aten(op_name, overload_name, inputs)


def is_tensor_argument(
    op_name: str, overload_name: str, index: int, is_input: bool, n_inputs: int = -1
) -> bool:
    """Whether input (or output) ``index`` of the operator is a tensor; ``n_inputs``, the
    node's input count, picks the overload when the name leaves it open."""
    own = _FUNCTIONS.get(op_name)
    if own is not None:
        return own.is_tensor(overload_name, index, is_input)
    op = aten_operator(op_name, overload_name, n_inputs)
    if is_input:
        return index < len(op.args) and op.args[index].kind == "Tensor"
    return index < len(op.returns) and op.returns[index] == "Tensor"


# -- the native callbacks -------------------------------------------------------------------------

# bool is_tensor_argument(const char* op_name, const char* overload_name, size_t index, bool is_input)
_IS_TENSOR = ctypes.CFUNCTYPE(
    ctypes.c_bool, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_bool
)
# void execute(const char* op_name, const char* overload_name, size_t input_size,
#              DLManagedTensor** inputs, size_t output_size, DLManagedTensor** outputs)
_EXECUTE = ctypes.CFUNCTYPE(
    None,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


def _no_delete(_address: int) -> None:
    return None


_NO_DELETE = _DELETER(_no_delete)
_POISON_DATA = ctypes.c_int64(0)
# A tensor whose dtype the engine's DLPack import rejects: returned in place of a result when
# the operator raised, it makes the engine fail the node with an error instead of reading garbage.
_POISON = _DLManagedTensor()
_POISON.dl_tensor.data = ctypes.addressof(_POISON_DATA)
_POISON.dl_tensor.device = _DLDevice(1, 0)
_POISON.dl_tensor.ndim = 0
_POISON.dl_tensor.dtype = _DLDataType(255, 8, 1)
_POISON.deleter = _NO_DELETE

_CALLS = [0]


def call_count() -> int:
    """How many ATen nodes the executor has run in this process."""
    return _CALLS[0]


def _is_tensor_entry(op_name: bytes, overload_name: bytes, index: int, is_input: bool) -> bool:
    try:
        return is_tensor_argument(
            op_name.decode(), (overload_name or b"").decode(), int(index), bool(is_input)
        )
    except BaseException as err:  # noqa: BLE001 - must not unwind through the engine
        logger.warning("ATen executor: cannot describe %s argument %d: %s", op_name, index, err)
        return False


def _execute_entry(
    op_name: bytes, overload_name: bytes, n_in: int, inputs: Any, n_out: int, outputs: Any
) -> None:
    name = op_name.decode()
    overload = (overload_name or b"").decode()
    try:
        # own every input first: their deleters must run even when the operator fails
        tensors = [
            bridge.tensor_from_pointer(inputs[i]) if inputs[i] else None for i in range(n_in)
        ]
        results = execute(name, overload, tensors)
        del tensors
        if len(results) > n_out and returns_list(name, overload, n_in):
            results = first_elements(name, results, n_out)
        if len(results) != n_out:
            raise UnsupportedAtenOperatorError(
                f"{name} returned {len(results)} values, the node has {n_out} outputs"
            )
        addresses = []
        for r in results:
            if r is None:
                addresses.append(0)
                continue
            r = r.detach()
            if r.dtype == torch.bool:  # the engine's DLPack import has no bool
                r = r.view(torch.uint8)
            if not r.numel():  # any empty tensor is "contiguous" to PyTorch, not to the engine
                r = torch.empty(r.shape, dtype=r.dtype, device=r.device)
            addresses.append(bridge.managed_pointer(r if r.is_contiguous() else r.contiguous()))
        for i, address in enumerate(addresses):
            outputs[i] = address or None
        _CALLS[0] += 1
    except BaseException as err:  # noqa: BLE001
        remember(err, f"raised while ONNX Runtime ran the ATen node {name}.{overload or 'default'}")
        for i in range(n_out):
            outputs[i] = ctypes.addressof(_POISON) if i == 0 else None


_IS_TENSOR_CALLBACK = _IS_TENSOR(_is_tensor_entry)
_EXECUTE_CALLBACK = _EXECUTE(_execute_entry)
_INSTALLED = False
_LOCK = threading.Lock()


def install() -> None:
    """Register the executor with the engine (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return

        is_tensor = ctypes.cast(_IS_TENSOR_CALLBACK, ctypes.c_void_p).value
        run = ctypes.cast(_EXECUTE_CALLBACK, ctypes.c_void_p).value
        _C().register_aten_op_executor(str(is_tensor), str(run))
        _INSTALLED = True


def installed() -> bool:
    return _INSTALLED
