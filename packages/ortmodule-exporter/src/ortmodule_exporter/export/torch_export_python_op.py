"""Custom ``torch.autograd.Function`` calls on the ``torch_export`` frontend: the TorchScript
frontend's ``com.microsoft::PythonOp``, whose forward and backward run the user's Function in
PyTorch (:mod:`ortmodule_exporter.python_op`).

torch.export inlines a Function's forward and drops its backward. So while it runs the forward,
each ``Function.apply`` of a user's Function (:func:`routed_apply`) calls one operator instead,
``ortmodule_python_op::apply(Tensor[] tensors, int call) -> Tensor[]``, which torch.export keeps
as one FX node: ``tensors`` are the tensor arguments, ``call`` the key of what the node cannot
carry (the Function class, its non-tensor arguments and where they go), kept in this process
for the length of the export (:func:`python_op_calls`). The operator's fake kernel runs the
Function's forward on the fake tensors for the output shapes (the Function's own code, as
eager runs it). The translation writes the FX node as the PythonOp the TorchScript symbolic
writes (same attributes, same registry entry: :func:`write_python_op`, called from the ATen
route's per-node lowering), so the runner, its checks (a model naming a Function this process
did not export is refused; nothing is imported by name) and the engine's PythonOp gradient are
shared.

Why an operator per call and not a higher-order op: a ``torch.library`` operator is kept whole by
torch.export and by the translator's decompositions with no tracing rule of our own, and the
ATen route already lowers custom operators node by node; a ``Tensor[] -> Tensor[]`` schema fits
every Function's arity. Non-tensor arguments (ints, floats, bools, None, tuples, objects) never
enter the FX graph; a SymInt among them (a size read with dynamic dims) is made a Python int,
which fixes that dim: the size guard then exports again for other sizes, as the TorchScript
trace bakes the traced size.

Refused with an :class:`ExportError` naming the Function: a forward that writes an argument in
place (``mark_dirty``; functionalization would need the operator to declare the write), a
tensor inside a container argument or output (it would be baked as the fake tensor it is
during export), keyword arguments left after binding, and a forward that cannot run on fake
tensors (data-dependent Python: the error says so).

>>> from ortmodule_exporter.export.torch_export_python_op import python_op_calls
>>> with python_op_calls(enabled=True):
...     pass
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, _SingleLevelFunction

from ..errors import ExportError
from ..python_op.registry import (
    PYTHON_OP_DOMAIN,
    REGISTRY,
    _register_with_engine,
    python_op_exporters,
)
from ..python_op.symbolic import _encode_constant, _Encoded
from ..torchscript_onnx import type_utils

logger = logging.getLogger("ortmodule.exporter")

#: the Functions whose special exporter was said to be passed over (once per process)
_SAID: set[str] = set()

__all__ = ["python_op_calls", "routed_apply", "is_python_op", "write_python_op"]

_NAMESPACE = "ortmodule_python_op"
_SCHEMA = "apply(Tensor[] tensors, int call) -> Tensor[]"


@dataclass
class _Call:
    """One ``Function.apply`` met while torch.export ran the forward."""

    cls: type
    name: str
    #: one letter per argument: ``d`` a tensor (an input of the operator), ``c`` anything else
    convention: str
    #: the non-tensor arguments by position
    constants: dict[int, Any]
    needs_input_grad: tuple[bool, ...]
    #: per output of the forward: None for a tensor (the operator's outputs, in order), else
    #: the non-tensor value itself; empty until the fake kernel ran
    outputs: list[Any] = field(default_factory=list)
    single: bool = False
    ran: bool = False


@dataclass
class _Scope:
    enabled: bool
    calls: dict[int, _Call] = field(default_factory=dict)


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "ortmodule_torch_export_python_op", default=None
)
#: the keys of every call in every export running now (the kernels find theirs by key: the
#: translator's decompositions run them again, outside the context the export started in)
_CALLS: dict[int, _Call] = {}
_KEYS = itertools.count(1)
_LOCK = threading.Lock()
#: set while a routed Function's forward runs for its shapes: Functions it applies run as they
#: are (they run the same way inside the PythonOp at run time)
_INSIDE = threading.local()


@contextlib.contextmanager
def python_op_calls(enabled: bool) -> Iterator[None]:
    """For the length of one export: user Functions are routed (``enabled``: the export's
    ``custom_autograd``) and their calls kept until the translation wrote them."""
    scope = _Scope(enabled)
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        with _LOCK:
            for key in scope.calls:
                _CALLS.pop(key, None)


def routing() -> bool:
    """Whether a Function applied now becomes a PythonOp (an export with custom_autograd)."""
    scope = _SCOPE.get()
    return scope is not None and scope.enabled and not getattr(_INSIDE, "depth", 0)


def inside_routed_forward() -> bool:
    return bool(getattr(_INSIDE, "depth", 0))


def _operator() -> Any:
    """``ortmodule_python_op::apply``, defined on first use (once per process)."""
    with _LOCK:
        if not hasattr(torch.ops, _NAMESPACE) or not hasattr(
            getattr(torch.ops, _NAMESPACE), "apply"
        ):
            library = torch.library.Library(_NAMESPACE, "DEF")
            library.define(_SCHEMA)
            library.impl("apply", _kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{_NAMESPACE}::apply", _kernel, lib=library)
            _LIBRARIES.append(library)  # a Library deregisters its operators when collected
    return getattr(torch.ops, _NAMESPACE).apply.default


_LIBRARIES: list[Any] = []


def is_python_op(target: Any) -> bool:
    """Whether an FX node's ``target`` is the operator a routed Function call became."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == _NAMESPACE


# -- the call, while torch.export runs the forward -----------------------------------------------


def _plain(value: Any) -> Any:
    """A SymInt/SymFloat/SymBool made a Python value (torch.export then fixes what it depends
    on, and the size guard checks it), in tuples and lists too."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    if isinstance(value, torch.Size):
        return tuple(int(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def _calls_setup_context(cls: type) -> bool:
    return (
        getattr(cls, "setup_context", _SingleLevelFunction.setup_context)
        is not _SingleLevelFunction.setup_context
    )


def routed_apply(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls.apply(*args, **kwargs)`` as one ``ortmodule_python_op::apply`` call."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _calls_setup_context(cls):
        # as Function.apply binds them
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)  # type: ignore[attr-defined]
        bound.apply_defaults()
        args, kwargs = tuple(bound.args), dict(bound.kwargs)
    if kwargs:
        raise ExportError(
            f"{name}.apply was given keyword arguments ({', '.join(kwargs)}), which a "
            "Function's forward does not take; pass them by position"
        )
    args = tuple(_plain(a) for a in args)
    convention = "".join("d" if isinstance(a, torch.Tensor) else "c" for a in args)
    for position, value in enumerate(args):
        if not isinstance(value, torch.Tensor) and _holds_tensor(value):
            raise ExportError(
                f"argument {position} of {name}.apply holds tensors inside a container: "
                "ORTMODULE_EXPORTER=torch_export runs a custom Function with its tensor "
                "arguments fed by the graph, and a container is not one; pass each tensor as "
                "an argument of apply(), or use ORTMODULE_EXPORTER=torchscript"
            )
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    call = _Call(
        cls,
        name,
        convention,
        {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)},
        tuple(bool(a.requires_grad) for a in tensors),
    )
    key = next(_KEYS)
    scope = _SCOPE.get()
    assert scope is not None
    with _LOCK:
        _CALLS[key] = call
    scope.calls[key] = call
    results = list(_operator()(tensors, key))
    if not call.ran:
        raise ExportError(f"{name}: its forward did not run for its output shapes")
    tensor_outputs = iter(results)
    outputs = [next(tensor_outputs) if o is None else o for o in call.outputs]
    return outputs[0] if call.single else tuple(outputs)


class _ShapeContext(FunctionCtx):
    """The ``ctx`` of a forward run for its output shapes (``Function.apply``'s own is made in
    C++, and the forward here runs by itself)."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self.to_save: tuple[Any, ...] = ()
        self.dirty_tensors: tuple[Any, ...] = ()
        self.non_differentiable: tuple[Any, ...] = ()

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self.to_save)


def _kernel(tensors: Sequence[torch.Tensor], call: int) -> list[torch.Tensor]:
    """The operator's kernel (fake tensors while exporting): the Function's forward, outputs
    made new contiguous tensors (the runner hands the engine contiguous outputs of its own)."""
    with _LOCK:
        entry = _CALLS.get(call)
    if entry is None:
        raise RuntimeError(
            f"{_NAMESPACE}::apply stands for a torch.autograd.Function call while ORTModule "
            "exports with torch.export; it does not run outside that export"
        )
    fed = iter(tensors)
    args = [
        next(fed) if kind == "d" else entry.constants[i] for i, kind in enumerate(entry.convention)
    ]
    needs = iter(entry.needs_input_grad)
    ctx = _ShapeContext(tuple(next(needs) if k == "d" else False for k in entry.convention))
    versions = [t._version for t in tensors]
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        with torch.no_grad():
            if _calls_setup_context(entry.cls):
                result = entry.cls.forward(*args)  # type: ignore[attr-defined]
                entry.cls.setup_context(ctx, tuple(args), result)  # type: ignore[attr-defined]
            else:
                result = entry.cls.forward(ctx, *args)  # type: ignore[attr-defined]
    except ExportError:
        raise
    except Exception as err:
        raise ExportError(
            f"the forward of the custom autograd.Function {entry.name} could not run on "
            f"torch.export's fake tensors for its output shapes: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}\n"
            "A forward that reads a tensor's value as a Python number cannot be exported by "
            "torch.export; use ORTMODULE_EXPORTER=torchscript"
        ) from err
    finally:
        _INSIDE.depth -= 1
    written = [i for i, t in enumerate(tensors) if t._version != versions[i]]
    if ctx.dirty_tensors or written:
        raise ExportError(
            f"the custom autograd.Function {entry.name} writes its argument in place "
            "(mark_dirty): ORTMODULE_EXPORTER=torch_export runs a custom Function as one "
            "operator that writes no argument. Return a new tensor instead of writing the "
            "argument, or use ORTMODULE_EXPORTER=torchscript"
        )
    outputs = result if isinstance(result, tuple) else (result,)
    shape: list[Any] = []
    returned: list[torch.Tensor] = []
    for position, out in enumerate(outputs):
        if isinstance(out, torch.Tensor):
            shape.append(None)
            returned.append(out.clone(memory_format=torch.contiguous_format))
        elif _holds_tensor(out):
            raise ExportError(
                f"output {position} of the custom autograd.Function {entry.name} holds tensors "
                "inside a container: return them as outputs of their own, or use "
                "ORTMODULE_EXPORTER=torchscript"
            )
        else:
            shape.append(out)
    if not entry.ran:
        entry.outputs = shape
        entry.single = not isinstance(result, tuple)
        entry.ran = True
    return returned


# -- the translation ----------------------------------------------------------------------------

_UINT8, _BOOL, _INT64 = 2, 9, 7  # onnx.TensorProto's UINT8, BOOL, INT64


def _onnx_type(dtype: torch.dtype) -> int:
    return int(type_utils.JitScalarType.from_dtype(dtype).onnx_type())  # type: ignore[call-overload]


def write_python_op(
    core: Any,
    node: torch.fx.Node,
    node_name_to_values: dict[str, Any],
    graph_like: Any,
    training: bool,
) -> None:
    """Write the FX node of a routed call as the TorchScript symbolic's PythonOp (and a Cast
    back to bool for each bool output, which crosses the engine as uint8)."""
    from onnxscript import ir  # noqa: PLC0415 - optional frontend

    tensors_arg, key = node.args
    with _LOCK:
        call = _CALLS.get(int(key))  # type: ignore[arg-type]
    if call is None or not call.ran:
        raise ExportError(f"{node.name}: a custom autograd.Function call this export did not make")
    entry = REGISTRY.register(call.cls)
    if entry.name in python_op_exporters() and entry.name not in _SAID:
        # a register_python_op_exporter handler writes TorchScript nodes (``g.op``): it has no
        # counterpart on this frontend, so the Function runs as itself (QLoRA's MatMul4Bit:
        # bitsandbytes' forward and backward instead of the engine's MatMulBnb4)
        _SAID.add(entry.name)
        logger.info(
            "ORTMODULE_EXPORTER=torch_export: %s runs as a PythonOp of the Function; its "
            "registered exporter (register_python_op_exporter) is for the TorchScript frontend",
            entry.name,
        )
    enc = _Encoded()
    inputs: list[Any] = []
    input_types: list[int] = []
    input_ranks: list[int] = []
    assert isinstance(tensors_arg, (list, tuple))
    fed = iter(tensors_arg)
    for position, kind in enumerate(call.convention):
        if kind == "c":
            _encode_constant(enc, position, call.constants[position], entry.name)
            continue
        source = next(fed)
        meta = source.meta["val"]
        onnx_type = _onnx_type(meta.dtype)
        if onnx_type == _BOOL:
            entry.bool_inputs.add(position)
        inputs.append(node_name_to_values[source.name])
        input_types.append(onnx_type)
        input_ranks.append(meta.dim())
    metas = list(node.meta["val"])
    output_types: list[int] = []
    output_ranks: list[int] = []
    tensor_metas = iter(metas)
    output_metas: list[Any] = []
    for out in call.outputs:
        if out is not None:  # a non-tensor output: a placeholder the runner leaves empty
            output_types.append(_INT64)
            output_ranks.append(0)
            output_metas.append(None)
            continue
        meta = next(tensor_metas)
        onnx_type = _onnx_type(meta.dtype)
        output_types.append(_UINT8 if onnx_type == _BOOL else onnx_type)
        output_ranks.append(meta.dim())
        output_metas.append(meta)
    attributes = [
        ir.AttrString("func_name", entry.name),
        ir.AttrString("input_convention", call.convention),
        ir.AttrInt64s("input_tensor_types", input_types),
        ir.AttrInt64s("input_tensor_ranks", input_ranks),
        ir.AttrInt64s("output_tensor_types", output_types),
        ir.AttrInt64s("output_tensor_ranks", output_ranks),
        ir.AttrInt64("training_mode", int(training)),
        ir.AttrInt64("safe_run_mode", 1),
        ir.AttrString("comment", ""),
    ]
    for name, values in enc.attrs.items():
        if name in ("input_float_scalars", "input_float_tuples"):
            attributes.append(ir.AttrFloat32s(name, [float(v) for v in values]))
        else:
            attributes.append(ir.AttrInt64s(name, [int(v) for v in values]))
    if enc.pointers:
        attributes.append(ir.AttrInt64s("input_pointer_scalars", enc.pointers))
        attributes.append(ir.AttrInt64s("input_pointer_scalar_positions", enc.pointer_positions))
    REGISTRY.record_node(entry.name, enc.pointers)
    _register_with_engine(entry.name)
    python_op = ir.Node(
        PYTHON_OP_DOMAIN, "PythonOp", inputs, attributes, num_outputs=1 + len(call.outputs)
    )
    python_op.name = f"node_{node.name}"
    context = python_op.outputs[0]
    context.name = f"{node.name}__context"
    context.dtype = ir.DataType.INT64
    context.shape = ir.Shape([])
    made = [python_op]
    results: list[Any] = []
    for i, (value, meta) in enumerate(zip(python_op.outputs[1:], output_metas, strict=True)):
        value.name = f"{node.name}__out{i}"
        if meta is None:
            value.dtype = ir.DataType.INT64
            value.shape = ir.Shape([])
            continue
        core._set_shape_type(value, meta, complex_to_float=True)
        if meta.dtype == torch.bool:
            value.dtype = ir.DataType.UINT8
            cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", _BOOL)])
            core._set_shape_type(cast.outputs[0], meta, complex_to_float=True)
            made.append(cast)
            value = cast.outputs[0]
        results.append(value)
    for i, value in enumerate(results):
        value.name = f"{node.name}__{i}"
    for n in made:
        n.meta["node"] = node
        core._set_node_metadata(node, n)
    graph_like.extend(made)
    node_name_to_values[node.name] = results
