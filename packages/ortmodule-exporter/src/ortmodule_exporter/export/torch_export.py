"""The ``torch_export`` frontend (``ORTMODULE_EXPORTER=torch_export``): ``torch.export`` + the
dynamo ONNX translator, giving the same graph interface as the TorchScript frontend.

1. ``torch.export.export`` (non-strict) captures the flat wrapper (:class:`TorchExportFlat`) in
   the module's own training mode, batch and sequence dims (every dim of every input, unless
   ``static_shapes``) as ``Dim.AUTO``: shapes stay symbolic (no ``Reshape`` to a traced size),
   a branch on a tensor's value is refused with PyTorch's data-dependent error, and the
   in-place writes to buffers and inputs are functionalized (the wrapper returns their new
   values as outputs, named as the TorchScript frontend names them).
2. ``torch.onnx.export(program, dynamo=True)`` translates the ATen graph to ONNX with
   onnxscript's torch_lib, with our translations where torch_lib's are inference-only
   (:data:`TRAINING_TRANSLATIONS`), without its optimizer (it constant-folds initializers,
   which here are the trained parameters).
3. The result is put in the TorchScript frontend's shape: local functions inlined, parameters
   and buffers as graph inputs without data named by their qualified names, user inputs named
   from their pytree paths, outputs by position.

Why not an FX -> ONNX lowering of our own: torch_lib already lowers every core ATen operator
(hundreds, with their dtype and broadcast rules); ours would start from zero and diverge. Its
training gaps are few and local, and a custom translation closes each (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference
import torch

from ortmodule_pytree import Schema, flatten, unflatten

from .. import onnx_graph
from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import fx_example_inputs
from ..errors import ExportError
from ..python_op.symbolic import custom_autograd_enabled
from .calls import ParameterWrites, call_bound, writable_buffers
from .gradient_cuts import plain_grad_switch
from .guards import Guard
from .model import BUFFER_WRITE_PREFIX, INPUT_WRITE_PREFIX
from .shape_guards import Dim, ShapeGuard, _Step
from .torch_export_aten import translated_with_aten_route
from .torch_export_fixes import fix_for_engine
from .torch_export_grad_cuts import cut_detached_gradients
from .torch_export_numbers import numbers_as_tensors
from .torch_export_python_op import (
    inside_routed_forward,
    python_op_calls,
    routed_apply,
    routing,
)
from .torch_export_routes import route_program
from .torch_lib_training import training_translations

logger = logging.getLogger("ortmodule.exporter")

#: the opset the dynamo translator writes: torch_lib's functions are written for opset 18 and
#: newer, and the engine (1.19.2) runs and differentiates up to 21
TORCH_EXPORT_MIN_OPSET = 18


@dataclass
class _Found:
    """What the wrapper's forward found out while torch.export ran it."""

    output_schema: Schema | None = None
    output_error: TypeError | None = None
    #: the forward wrote a parameter (:class:`ParameterWrites`)
    state_error: ExportError | None = None
    written_inputs: list[int] = field(default_factory=list)
    written_buffers: list[str] = field(default_factory=list)
    #: the torch.autograd.Function subclasses the forward applied, by qualified name
    functions: list[str] = field(default_factory=list)


class TorchExportFlat(torch.nn.Module):
    """Flat tensors in, flat tensors out, for ``torch.export``: the user's outputs, then the new
    values of the inputs and buffers the forward wrote in place (found from their version
    counters, which functionalization keeps moving under export)."""

    def __init__(self, module: torch.nn.Module, input_schema: Schema, wrapped_name: str) -> None:
        super().__init__()
        self._wrapped_name = wrapped_name
        setattr(self, wrapped_name, module)
        self._input_schema = input_schema
        # torch.export puts back the module attributes a forward assigns: what the forward
        # finds is kept in this record, which it changes but never replaces
        self._found = _Found()
        # what the TorchScript wrapper also reports: export runs on fake tensors (no traced
        # values: constant outputs are computed from the graph, ``_drop_constant_outputs``)
        # and refuses data-dependent Python (no guards)
        self.traced_outputs: tuple[torch.Tensor, ...] = ()
        self.guards: list[Any] = []
        #: what torch.export assumed of the input sizes (:func:`size_guards`), set after export
        self.shape_guards: list[ShapeGuard] = []

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arguments = unflatten(list(flat), self._input_schema)
        module = getattr(self, self._wrapped_name)
        buffers = writable_buffers(module)
        input_versions = [t._version for t in flat]
        buffer_versions = {name: b._version for name, b in buffers.items()}
        params = ParameterWrites(module)
        with _recording_functions(self._found.functions):
            out = call_bound(module, arguments)
        try:
            params.refuse()
        except ExportError as err:
            self._found.state_error = err
            raise
        try:
            tensors, schema = flatten(out, prefix="output")
        except TypeError as err:
            self._found.output_error = err
            raise
        found = self._found
        found.output_schema = schema
        found.written_inputs = [i for i, t in enumerate(flat) if t._version != input_versions[i]]
        found.written_buffers = [n for n, b in buffers.items() if b._version != buffer_versions[n]]
        written = [flat[i] for i in found.written_inputs] + [
            buffers[n] for n in found.written_buffers
        ]
        # a returned buffer or input is a view of the state export lifts: a clone keeps the
        # output a value of its own
        return (*tensors, *(w.clone() for w in written))

    @property
    def output_schema(self) -> Schema | None:
        return self._found.output_schema

    @property
    def output_error(self) -> TypeError | None:
        return self._found.output_error

    @property
    def written_inputs(self) -> list[int]:
        return self._found.written_inputs

    @property
    def written_buffers(self) -> list[str]:
        return self._found.written_buffers

    @property
    def functions(self) -> list[str]:
        return self._found.functions

    def extra_output_names(self) -> list[str]:
        """Names of the outputs after the user's, as the TorchScript frontend names them."""
        names = self._input_schema.names
        return [
            *(f"{INPUT_WRITE_PREFIX}{names[i]}" for i in self.written_inputs),
            *(f"{BUFFER_WRITE_PREFIX}{n}" for n in self.written_buffers),
        ]


# Functions whose backward is the derivative of their forward, recomputed: inlining them
# (what torch.export does with every Function) keeps the gradient
_INLINE_SAFE_FUNCTIONS = ("torch.utils.checkpoint.CheckpointFunction",)


@contextlib.contextmanager
def _recording_functions(seen: list[str]) -> Iterator[None]:
    """Route or record every ``torch.autograd.Function.apply`` while torch.export runs the
    forward.

    torch.export inlines a Function's forward and drops its backward: the engine would then
    differentiate the forward (a straight-through estimator's round() has a zero gradient).
    A user's Function becomes one operator written as a PythonOp
    (:mod:`.torch_export_python_op`) when the export makes PythonOps (``custom_autograd``);
    else, and for the Functions torch applies below the traced level (a custom operator's
    autograd), the call is recorded and the caller refuses the graph unless it is safe
    (:func:`export_program`). Functions applied inside a routed Function's forward run as they
    are: at run time that forward runs in PyTorch.
    """
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if inside_routed_forward():
            return original.__func__(cls, *args, **kwargs)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if (
            routing()
            and name not in _INLINE_SAFE_FUNCTIONS
            and not name.startswith(_GENERATED_BACKWARD)
        ):
            return routed_apply(cls, args, kwargs)
        if name not in seen:
            seen.append(name)
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]


def _custom_operator_functions(program: torch.export.ExportedProgram) -> set[str]:
    """The Functions that are the autograd of custom operators the graph holds as nodes.

    A custom operator's registered autograd (``torch.library.custom_op`` +
    ``register_autograd``) runs as the Function ``torch._library.autograd.
    GeneratedBackwardFor_<namespace>_<name>_<overload>``. Unlike a user's Function, torch.export
    keeps the operator as one node (its OpOverload), which the ATen route hands to PyTorch with
    its autograd: nothing is inlined, so the backward is kept. Only the operators found as
    nodes count: one whose forward was traced through (its Function applied, no node of it)
    stays refused."""
    names: set[str] = set()
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            target = node.target
            if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
                names.add(
                    f"{_GENERATED_BACKWARD}{target.namespace}_"
                    f"{target._opname}_{target._overloadname}"
                )
    return names


#: how torch names the Function of a custom operator's registered autograd
#: (``torch._library.autograd.make_autograd_impl``)
_GENERATED_BACKWARD = "torch._library.autograd.GeneratedBackwardFor_"


def _contiguous_as_clones(program: torch.export.ExportedProgram) -> None:
    """Every ``aten.contiguous`` of ``program`` becomes a contiguous ``aten.clone``, in place.

    torch.export keeps ``contiguous`` (a composite operator) in the graph, and torch.onnx
    keeps it through its decomposition, as it translates it (an Identity). Retraced there with
    size-oblivious shapes, its fake output keeps its input's strides, so a following
    ``reshape`` of a transposed tensor becomes a ``view`` that the retrace then refuses
    ("Cannot view a tensor with shape ..."; HF umt5's attention output). A clone in contiguous
    format holds the same values, is translated to the same Identity, and its fake output is
    contiguous.
    """
    contiguous = torch.ops.aten.contiguous.default
    changed = False
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is contiguous:
            fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else None)
            node.target = torch.ops.aten.clone.default
            node.args = node.args[:1]
            node.kwargs = {"memory_format": fmt or torch.contiguous_format}
            changed = True
    if changed:
        program.graph_module.recompile()


def _why_not_routed() -> str:
    if not custom_autograd_enabled():
        return (
            "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 turns off the PythonOp that runs its backward: "
            "turn it on, or use ORTMODULE_EXPORTER=torchscript."
        )
    # a custom operator's autograd whose forward torch.export traced through (no node of the
    # operator), or a Function torch applied below the traced level
    return (
        "It was applied below the level torch.export traces, where it cannot be routed to a "
        "PythonOp: use ORTMODULE_EXPORTER=torchscript."
    )


def _dynamic_shapes(tensors: Sequence[torch.Tensor], static_shapes: bool) -> Any:
    if static_shapes:
        return None
    auto = torch.export.Dim.AUTO
    # One entry per forward parameter: the wrapper's is ``*flat``, a tuple of all the tensors.
    # A zero-element tensor keeps its dims fixed: its shape is part of the input schema anyway
    # (ortmodule_pytree: another empty shape is another graph), and with symbolic dims the
    # empty outputs computed from it carry SymInts into the output schema, which cannot be
    # hashed when the run rebuilds the outputs ("unhashable type: non-nested SymInt").
    return (
        tuple(
            {i: auto for i in range(t.dim())} if t.dim() and t.numel() else None for t in tensors
        ),
    )


# -- the export ---------------------------------------------------------------------------------


def export_program(
    flat: TorchExportFlat,
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    opset: int,
    static_shapes: bool,
    where: str,
    training: bool = True,
) -> onnx.ModelProto:
    """``flat`` (already in the mode to export in) -> the ONNX model, inputs named ``names``
    then every parameter and buffer the graph reads, without data. Operators the translator
    cannot lower, or (``training``) lowers to ONNX the engine cannot differentiate, take the
    ATen route (:mod:`.torch_export_aten`); custom autograd.Functions are PythonOps
    (:mod:`.torch_export_python_op`) when the export config's ``custom_autograd`` is on."""
    # PyTorch's own grad switch while torch.export and the translator trace (gradient_cuts:
    # the TorchScript frontend's recorder in its place lost torch.no_grad() regions)
    with python_op_calls(enabled=custom_autograd_enabled()), plain_grad_switch():
        return _export_program(flat, tensors, names, opset, static_shapes, where, training)


def _export_program(
    flat: TorchExportFlat,
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    opset: int,
    static_shapes: bool,
    where: str,
    training: bool,
) -> onnx.ModelProto:
    try:
        import onnxscript  # noqa: F401, PLC0415
    except ImportError as err:
        raise ExportError(
            "ORTMODULE_EXPORTER=torch_export needs onnxscript (pip install onnxscript); "
            "unset ORTMODULE_EXPORTER for the TorchScript exporter",
            module_path=where,
        ) from err
    try:
        program = torch.export.export(
            flat,
            tuple(tensors),
            dynamic_shapes=_dynamic_shapes(tensors, static_shapes),
            strict=False,
        )
    except Exception as err:
        if flat.output_error is not None:
            raise
        if flat._found.state_error is not None:
            raise flat._found.state_error from err
        refused = _refusal(err)
        if refused is not None:
            # a custom Function that cannot be a PythonOp here (torch_export_python_op)
            raise ExportError(f"{where}: {refused}", module_path=where) from err
        hint = ""
        if _data_dependent(err):
            hint = (
                "\nThe forward branches on (or reads as a Python value) a tensor's data, which "
                "torch.export does not capture: compute it with tensor ops (torch.where, "
                "torch.cond), or use ORTMODULE_EXPORTER=torchscript, which guards the value the "
                "trace saw."
            )
        raise ExportError(
            f"torch.export could not capture {where}: {type(err).__name__}: "
            f"{_first_lines(str(err))}{hint}",
            module_path=where,
        ) from err
    _contiguous_as_clones(program)
    numbers_as_tensors(program)
    if training:
        cut_detached_gradients(program, tensors)
    # the opt-in ATen routes (attention, dropout): operators the ATen route writes whole
    routed_whole = route_program(program)
    kept = _custom_operator_functions(program)
    functions = [f for f in flat.functions if f not in _INLINE_SAFE_FUNCTIONS and f not in kept]
    if functions:
        raise ExportError(
            f"{where} applies the custom autograd.Function {', '.join(functions)}: torch.export "
            "keeps its forward and drops its backward, so the engine would differentiate the "
            f"forward instead (wrong gradients). {_why_not_routed()}",
            module_path=where,
        )
    try:
        with (
            warnings.catch_warnings(),
            # a cross-entropy's label density is the example batch's (aten.kernel_choice)
            fx_example_inputs(program.graph_signature.user_inputs, tensors),
        ):
            warnings.simplefilter("ignore")
            onnx_program, _route = translated_with_aten_route(
                lambda routed: torch.onnx.export(
                    program,
                    (),
                    dynamo=True,
                    opset_version=opset,
                    optimize=False,
                    verbose=False,
                    custom_translation_table={**training_translations(opset), **routed},
                ),
                training,
                keep_whole=routed_whole,
            )
    except Exception as err:
        refused = _refusal(err)
        if refused is not None:
            # one of our translations refused an operator (torch_lib_training): its message
            raise ExportError(f"{where}: {refused}", module_path=where) from err
        raise ExportError(
            f"the ONNX translation of {where}'s torch.export graph failed: "
            f"{type(err).__name__}: {_first_lines(str(err))}",
            module_path=where,
        ) from err
    assert onnx_program is not None
    if not static_shapes:
        flat.shape_guards = size_guards(program, names, tensors)
    model = onnx_program.model_proto
    # the signature after the translator's decompositions, which make in-place writes functional
    decomposed = getattr(onnx_program, "exported_program", None) or program
    _writes_of_aten_nodes(model, decomposed, flat, names, where)
    return _as_training_graph(model, program, names, where, canonical_state_names(flat))


def _writes_of_aten_nodes(
    model: onnx.ModelProto,
    program: torch.export.ExportedProgram,
    flat: TorchExportFlat,
    names: Sequence[str],
    where: str,
) -> None:
    """The buffers and inputs that an ATen node's operator writes in place become written
    ones (graph outputs the runtime copies back), as those the wrapper found are.

    The wrapper finds writes by version counters, which some kernels do not move:
    ``aten._batch_norm_with_update`` updates its running statistics without (nor does
    ``F.batch_norm`` in eager). torch.export knows the write from the operator's schema (its
    functional form returns the new values, the graph signature says whose) but the translator
    drops those outputs: the running statistics would silently stay as they were. Where the
    translator lowers the operator, our translations write what the engine computes
    (``BatchNormalization``, whose running statistics the BatchNorm pass writes back); where an
    ATen node computes them (PyTorch's kernel), they are written back here.
    """
    sig = program.graph_signature
    produced = {o: n for n in model.graph.node if n.domain == ATEN_DOMAIN for o in n.output}
    prefix = f"{flat._wrapped_name}."
    user_inputs = list(sig.user_inputs)
    found = flat._found
    new_inputs: list[tuple[int, str]] = []
    new_buffers: list[tuple[str, str]] = []
    for value, buffer in sig.buffers_to_mutate.items():
        name = buffer[len(prefix) :] if buffer.startswith(prefix) else buffer
        if value in produced and name not in found.written_buffers:
            new_buffers.append((name, value))
    for value, placeholder in sig.user_inputs_to_mutate.items():
        index = user_inputs.index(placeholder) if placeholder in user_inputs else -1
        if value in produced and index >= 0 and index not in found.written_inputs:
            new_inputs.append((index, value))
    if not new_buffers and not new_inputs:
        return
    graph = model.graph
    types = {vi.name: vi for vi in (*graph.value_info, *graph.output)}
    outputs = list(graph.output)
    user = len(outputs) - len(found.written_inputs) - len(found.written_buffers)
    h = onnx.helper

    def output(value: str, out: str) -> onnx.ValueInfoProto:
        graph.node.append(h.make_node("Identity", [value], [out]))
        made = onnx.ValueInfoProto()
        if value in types:
            made.CopyFrom(types[value])
        made.name = out
        return made

    inputs = [
        output(value, f"{INPUT_WRITE_PREFIX}{names[index]}_aten") for index, value in new_inputs
    ]
    buffers = [output(value, f"{BUFFER_WRITE_PREFIX}{name}_aten") for name, value in new_buffers]
    split = user + len(found.written_inputs)
    del graph.output[:]
    graph.output.extend([*outputs[:split], *inputs, *outputs[split:], *buffers])
    found.written_inputs.extend(index for index, _ in new_inputs)
    found.written_buffers.extend(name for name, _ in new_buffers)
    logger.debug(
        "%s: ATen nodes write %s in place",
        where,
        ", ".join([*(names[i] for i, _ in new_inputs), *(n for n, _ in new_buffers)]),
    )


def size_guards(
    program: torch.export.ExportedProgram, names: Sequence[str], tensors: Sequence[torch.Tensor]
) -> list[ShapeGuard]:
    """What torch.export assumed of the input sizes, checked before each run.

    ``Dim.AUTO`` asks for every dim to stay symbolic, but torch.export fixes a dim whose size
    the forward uses as a Python int (``range(x.shape[3])``: a loop unrolled that many times,
    and size 0/1 dims), bounds one a branch compared (``if x.shape[0] > 3``, a range
    constraint) and makes equal the dims it found equal (one symbol). The ONNX graph holds
    these assumptions without checking them: fed other sizes, it runs and returns the traced
    loop's outputs, silently wrong. This guard's value is, in order, every fixed dim's size,
    then 1 for each bound and equality that holds (0 where not): on another value the runtime
    exports a graph for the new sizes, as for the TorchScript frontend's size guards. A dim
    given by an expression of other dims (``2 * s0``) is checked as a fixed size.
    """
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user = [nodes[n] for n in program.graph_signature.user_inputs if n in nodes]
    if len(user) != len(names):
        return []
    int64 = onnx.TensorProto.INT64
    steps: list[_Step] = []
    parts: list[str] = []
    traced: list[int] = []
    said: list[str] = []
    shapes: dict[str, tuple[Dim, ...]] = {}
    first: dict[Any, str] = {}

    def constant(value: int) -> str:
        out = f"size_guard/const{len(steps)}"
        steps.append(_Step("Constant", (), out, (("value", np.array(value, np.int64)),)))
        return out

    def size(name: str, axis: int) -> str:
        out = f"size_guard/{name}/{axis}"
        if not any(s.output == out for s in steps):
            shape = f"size_guard/{name}/shape"
            if name not in shapes:
                shapes[name] = tuple(
                    Dim(name, a) for a in range(len(tensors[names.index(name)].shape))
                )
                steps.append(_Step("Shape", (name,), shape, ()))
            steps.append(_Step("Gather", (shape, constant(axis)), out, (("axis", 0),)))
        return out

    def holds(op: str, a: str, b: str, text: str) -> None:
        out = f"size_guard/check{len(steps)}"
        steps.append(_Step(op, (a, b), out, ()))
        steps.append(_Step("Cast", (out,), out + "/int", (("to", int64),)))
        parts.append(out + "/int")
        traced.append(1)
        said.append(text)

    for name, node, tensor in zip(names, user, tensors, strict=True):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for axis, dim in enumerate(value.shape):
            where = f"{name}.shape[{axis}]"
            expr = dim.node.expr if isinstance(dim, torch.SymInt) else None
            if expr is None or not getattr(expr, "is_Symbol", False):
                # fixed by torch.export, or an expression of other dims: this size only
                parts.append(size(name, axis))
                traced.append(int(tensor.shape[axis]))
                said.append(f"{where} == {int(tensor.shape[axis])}")
                continue
            if expr in first:
                holds("Equal", size(name, axis), first[expr], f"{where} == {first[expr]}")
                continue
            first[expr] = size(name, axis)
            bounds = program.range_constraints.get(expr)
            lower = int(bounds.lower) if bounds is not None else 0
            upper = bounds.upper if bounds is not None else None
            # 0 and 1 are what Dim.AUTO leaves out by itself (both fixed when traced): a
            # bound above 2 is one the forward's code set
            if lower > 2:
                holds("Greater", first[expr], constant(lower - 1), f"{where} >= {lower}")
            # (``int_oo``, torch's unbounded size, says it is finite: only an Integer is)
            if upper is not None and getattr(upper, "is_Integer", False):
                holds("Less", first[expr], constant(int(upper) + 1), f"{where} <= {int(upper)}")
    if not parts:
        return []
    steps.append(_Step("Concat", tuple(parts), "size_guard/value", (("axis", 0),)))
    guard = Guard(
        "int",
        torch.tensor(traced, dtype=torch.int64),
        "torch.export's assumptions on the input sizes: " + ", ".join(said),
    )
    return [ShapeGuard(guard, tuple(steps), "size_guard/value", tuple(shapes.items()))]


def _refusal(err: BaseException) -> str | None:
    """The message of an :class:`ExportError` raised inside the translation, if one was."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ExportError):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    return None


def _data_dependent(err: BaseException) -> bool:
    """Whether ``err`` is torch.export refusing a branch on (or a read of) a tensor's value."""
    text = f"{type(err).__name__}: {err}"
    return "DataDependent" in text or "data-dependent" in text or "data dependent" in text


def _first_lines(text: str, n: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:n])


def canonical_state_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name of a parameter or buffer -> the name ``named_parameters()`` /
    ``named_buffers()`` give it (the first). A tied weight (an embedding shared with the LM
    head) has two names, and torch.export may lift it under either; the runtime feeds and
    trains parameters by the first."""
    canonical: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def _as_training_graph(
    model: onnx.ModelProto,
    program: torch.export.ExportedProgram,
    names: Sequence[str],
    where: str,
    canonical: dict[str, str],
) -> onnx.ModelProto:
    """Inline local functions, make initializers (parameters, buffers) graph inputs without
    data, rename user inputs to ``names``. Lifted constants stay initializers."""
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
        del model.functions[:]
    fix_for_engine(model)
    graph = model.graph
    sig = program.graph_signature
    state = set(sig.inputs_to_parameters.values()) | set(sig.inputs_to_buffers.values())
    user = [vi for vi in graph.input]
    if len(user) != len(names):
        raise ExportError(
            f"the torch.export graph of {where} has {len(user)} inputs for {len(names)} tensors",
            module_path=where,
        )
    renames = {vi.name: name for vi, name in zip(user, names, strict=True)}
    kept_inits = []
    state_inputs = []
    for init in graph.initializer:
        if init.name in state:
            vi = onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            state_inputs.append(vi)
        else:
            kept_inits.append(init)
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    graph.input.extend(state_inputs)
    for vi in state_inputs:
        if canonical.get(vi.name, vi.name) != vi.name:
            renames[vi.name] = canonical[vi.name]
    for old, new in renames.items():
        if old != new:
            onnx_graph.rename_value(graph, old, new)
    # two names of one tied tensor, both lifted, are one input now
    first: dict[str, onnx.ValueInfoProto] = {}
    for vi in graph.input:
        first.setdefault(vi.name, vi)
    unique = list(first.values())
    if len(unique) != len(graph.input):
        del graph.input[:]
        graph.input.extend(unique)
    return model
