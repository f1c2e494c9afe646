"""The ATen route of the ``torch_export`` frontend: FX operators the dynamo translator cannot
lower, or lowers to ONNX the engine cannot differentiate, become ``org.pytorch.aten::ATen``
nodes that PyTorch runs and differentiates inside the engine.

The decision is the TorchScript frontend's (:mod:`ortmodule_exporter.aten.untrainable`), taken
at the same place: that frontend wraps torch's per-node symbolic dispatch, this one wraps the
dynamo translator's per-node lowering (``_core._handle_call_function_node_with_lowering``).
For each ``aten`` operator node of the ExportedProgram, and each custom operator's
(``torch.library.custom_op``, which torch.export keeps as one node and the translator has no
translation for: PyTorch runs it and differentiates it with its registered autograd):

* its translation fails (torch_lib has none for it, or raises on its arguments): the node is an
  ATen node;
* in a training export, the ONNX nodes its translation wrote hold one the engine has no gradient
  builder for (asked of the engine: :func:`~ortmodule_exporter.aten.engine_gradients.
  engine_has_gradient`), or control flow, on a float path from its inputs: the ONNX nodes are
  dropped and the node is an ATen node;
* an operator the translator decomposed (it has no torch_lib translation) into ``prims`` that
  fail: the translation runs again with that operator kept whole (a custom translation keeps it
  from being decomposed), and it is an ATen node.

The ATen node is the one the TorchScript route writes (``operator``/``overload_name``
attributes, every schema argument an input, non-tensor ones as constants, missing ones empty),
so the same post-export pass (:func:`ortmodule_exporter.passes.aten_nodes.prepare_aten_nodes`),
executor and gradients (a registered ATen gradient, else a PythonOp running
:class:`~ortmodule_exporter.aten.aten_op.AtenOp`) take it from there.

Why wrap the per-node lowering rather than register custom translations or rewrite the FX
graph first: the decision needs what the translation wrote (which ONNX ops, on which path) and
whether it failed, which only the lowering sees; a custom translation is keyed by overload and
gets ONNX values, not the FX node (its schema arguments, its output metadata); an FX rewrite
would have to predict torch_lib's lowering. The wrapped function is private to torch.onnx (as
``_run_symbolic_function`` is to the TorchScript exporter): when it is missing, the route is off
and the translation is torch's own.

>>> from ortmodule_exporter.export.torch_export_aten import translated_with_aten_route
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnx
import torch

from ..aten import executor as aten_executor
from ..aten.engine_gradients import engine_has_gradient
from ..aten.engine_kernels import cpu_kernel_exists
from ..aten.executor import ATEN_DOMAIN, UnsupportedAtenOperatorError
from ..aten.routes import registered_aten_routes
from ..torchscript_onnx import type_utils
from .torch_export_kernel_choice import write_kernel_choice
from .torch_export_python_op import is_python_op, write_python_op
from .torch_export_values import added_for, constant, one_value

__all__ = ["AtenRoute", "translated_with_aten_route"]

logger = logging.getLogger("ortmodule.exporter")

T = TypeVar("T")

#: ONNX operators without an engine gradient that the frontend's graph fixes rewrite into ones
#: with a gradient (``torch_export_fixes._cast_like_as_cast``: CastLike -> Cast). torch_lib writes
#: a CastLike for nearly every Python scalar it combines with a tensor; counting it would send
#: nearly every operator to PyTorch.
_REWRITTEN_AFTER_TRANSLATION = frozenset({"CastLike"})

_LOCK = threading.Lock()

#: operators whose ONNX translation is right but picks otherwise than PyTorch where the result
#: is not unique, and the pick decides what follows: PyTorch runs them (the TorchScript
#: frontend's answer for topk is ``aten/topk.py``)
_PYTORCH_PICKS: dict[Any, str] = {
    # ONNX TopK puts the lower index first among equal values, PyTorch's CPU kernel does not
    # (``torch.topk(torch.full((4,), 0.5), 2)``: indices [2, 3]); a router with a zero gate
    # (AFMoE) scores every expert the same, and the engine sent tokens to other experts than
    # eager did (the first loss 4.8314 against 4.8422)
    torch.ops.aten.topk.default: "PyTorch breaks ties as eager does (ONNX TopK: lower index first)",
    # torch_lib draws it from the engine's generator (-log of a RandomUniformLike): another
    # sample than eager's under the same seed. The TorchScript frontend has no symbolic for it
    # and runs it in PyTorch, from PyTorch's generator as eager; PhiMoE's router samples its
    # experts with it in training
    torch.ops.aten.exponential.default: "PyTorch draws it from its generator, as eager does",
    # wrong through torch_lib and the engine (the full OpInfo sweep of 2026-11-27): log_sigmoid
    # lost precision far below zero (-8.4787 for eager's -8.4786 at x = -8.48; OpInfo's
    # multilabel_soft_margin_loss off by 3e-4); log_ndtr's and _safe_softmax's gradients were
    # NaN where eager's are finite (far in the tail; a row that is all -inf)
    torch.ops.aten.log_sigmoid.default: "torch_lib's log_sigmoid loses precision",
    torch.ops.aten.special_log_ndtr.default: "its gradient through torch_lib is NaN in the tail",
    torch.ops.aten._safe_softmax.default: "its gradient through the engine is NaN on -inf rows",
}


def _embedding_padding(node: torch.fx.Node) -> str | None:
    """An embedding with a ``padding_idx`` or ``scale_grad_by_freq``: torch_lib writes a
    ``Gather``, whose engine gradient gave the padding row the gradient eager keeps at zero
    (off by 21 in a test, silently) and does not scale by frequency."""
    args = list(node.args) + [None] * 5
    padding = args[2] if args[2] is not None else node.kwargs.get("padding_idx", -1)
    by_freq = args[3] if args[3] is not None else node.kwargs.get("scale_grad_by_freq", False)
    if (isinstance(padding, int) and padding >= 0) or by_freq is True:
        return "its padding row or frequency scaling needs PyTorch's embedding_backward"
    return None


#: operators PyTorch runs in some forms only: target -> the form's reason, or None
_PYTORCH_FORMS: dict[Any, Callable[[torch.fx.Node], str | None]] = {
    torch.ops.aten.embedding.default: _embedding_padding,
}


def _pytorch_pick(node: torch.fx.Node) -> str | None:
    """Why PyTorch runs ``node`` whatever its translation (:data:`_PYTORCH_PICKS`, and the
    forms of :data:`_PYTORCH_FORMS`), or None."""
    target = _canonical(node.target)
    if target in _PYTORCH_PICKS:
        return _PYTORCH_PICKS[target]
    form = _PYTORCH_FORMS.get(target)
    return form(node) if form is not None else None


#: those of PyTorch's picks the translator decomposes (no torch_lib function of their own): kept
#: whole from the first translation, else they never reach the route as themselves
_DECOMPOSED_PICKS = frozenset(
    {
        torch.ops.aten.exponential.default,
        torch.ops.aten.log_sigmoid.default,
        torch.ops.aten.special_log_ndtr.default,
        torch.ops.aten._safe_softmax.default,
    }
)


@dataclass
class AtenRoute:
    """One translation's route: what it routed and what it found to keep whole next time."""

    training: bool
    #: operators the translation must not decompose: each node of one is an ATen node
    whole: frozenset[Any] = frozenset()
    #: ``"aten::name.overload: reason"`` for each node routed
    routed: list[str] = field(default_factory=list)
    #: operators whose decomposition failed to translate (kept whole on a retry)
    decomposed: set[Any] = field(default_factory=set)
    #: each ATen node written and its number of inputs (one per schema argument)
    written: list[tuple[Any, int]] = field(default_factory=list)

    def restore_inputs(self) -> None:
        """Give each ATen node back the trailing empty inputs the translator's dead-code pass
        removed (ONNX lets an optional trailing input be left out; the executor reads the
        node's inputs as the operator's arguments, one each, and calls the operator with
        as many)."""
        for node, count in self.written:
            if len(node.inputs) < count:
                node.resize_inputs(count)


def translated_with_aten_route(
    translate: Callable[[Mapping[Any, Any]], T], training: bool, keep_whole: Iterable[Any] = ()
) -> tuple[T, AtenRoute]:
    """``translate(translations)`` (a ``torch.onnx.export`` call that adds ``translations`` to
    its custom translation table) with the ATen route installed, once more for each new set of
    operators whose decomposition failed; returns its result and the route taken.

    Without the ATen executor (``aten.executor.install``, which ORTModule does) nothing is
    routed, as for the TorchScript frontend (``operator_export_type``). ``keep_whole``: operators
    every node of which is an ATen node (those the opt-in routes wrote, ``torch_export_routes``).
    """
    whole: set[Any] = (
        {*_DECOMPOSED_PICKS, *keep_whole, *_registered_overloads()}
        if aten_executor.installed()
        else set()
    )
    while True:
        route = AtenRoute(training, frozenset(whole))
        with _installed(route):
            try:
                result = translate({op: _kept_whole for op in whole})
            except Exception:
                new = route.decomposed - whole
                if not new:
                    raise
                logger.debug("translating again, with %s kept whole", sorted(map(str, new)))
                whole |= new
                continue
        route.restore_inputs()
        if route.routed:
            logger.debug("ATen route: %s", "; ".join(route.routed))
        return result, route


def _registered_overloads() -> set[Any]:
    """Every overload of the operators given to ``register_aten_route``: kept whole from the
    first translation, as a decomposed one never reaches the route as itself."""
    found: set[Any] = set()
    for op in registered_aten_routes():
        packet = getattr(torch.ops.aten, op.split("::", 1)[1], None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found.add(getattr(packet, overload))
    return found


def _kept_whole(*args: Any, **kwargs: Any) -> Any:
    """The translation an operator kept whole has: never called, as the route writes the node
    before dispatch; reached only when the executor cannot run it after all."""
    raise UnsupportedAtenOperatorError(
        "the ATen route kept this operator whole, and the ATen executor cannot run it"
    )


@contextlib.contextmanager
def _installed(route: AtenRoute) -> Iterator[None]:
    try:
        from torch.onnx._internal.exporter import _core  # noqa: PLC0415 - optional frontend
    except ImportError:
        yield
        return
    original = getattr(_core, "_handle_call_function_node_with_lowering", None)
    if original is None:
        yield
        return
    with _LOCK:  # one translation at a time patches the module
        _core._handle_call_function_node_with_lowering = _routing(original, route, _core)
        try:
            yield
        finally:
            _core._handle_call_function_node_with_lowering = original


class _Captured:
    """Stands for the graph the lowering adds its nodes to, so they can be looked at first."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def extend(self, nodes: Sequence[Any]) -> None:
        self.nodes.extend(nodes)


def _routing(original: Any, route: AtenRoute, core: Any) -> Any:
    def lower(
        model: Any,
        node: torch.fx.Node,
        node_name_to_values: dict[str, Any],
        *,
        graph_like: Any,
        **rest: Any,
    ) -> None:
        target = node.target
        if is_python_op(target):
            # a custom autograd.Function's call (torch_export_python_op): its PythonOp
            write_python_op(core, node, node_name_to_values, graph_like, route.training)
            return
        if not _routable(target) or not aten_executor.installed():
            original(model, node, node_name_to_values, graph_like=graph_like, **rest)
            return
        functions = rest["node_name_to_local_functions"]
        if write_kernel_choice(
            core, node, node_name_to_values, functions, graph_like, route.written
        ):
            return  # PyTorch's kernel, where the kernel choice chose it (aten.kernel_choice)
        writer = _AtenWriter(core, node, node_name_to_values, functions, route)
        picked = _pytorch_pick(node)
        if picked is not None and writer.write(graph_like):
            route.routed.append(f"{_label(target)}: {picked}")
            return
        if _canonical(target) in route.whole and writer.write(graph_like):
            # a failed decomposition, an opt-in route's operator, or one register_aten_route got
            route.routed.append(f"{_label(target)}: kept whole")
            return
        captured = _Captured()
        # the lowering keeps the Constant nodes it writes for Python values in this cache, for
        # later nodes to read: ones of a lowering dropped here must leave it too
        farm = rest["constant_farm"]
        cached = set(farm)
        try:
            original(model, node, node_name_to_values, graph_like=captured, **rest)
        except Exception as err:
            _forget_new(farm, cached)
            if writer.write(graph_like):
                route.routed.append(f"{_label(target)}: its translation failed ({_cause(err)})")
                return
            raise
        reasons: list[str] = []
        if route.training:
            inputs = _float_inputs(node, node_name_to_values)
            reasons = _untrainable(captured.nodes, set(inputs), model)
            reached = _reached(captured.nodes, inputs, model, reasons)
            if not reasons and inputs and _cuts_gradient(node, node_name_to_values, reached):
                reasons = ["its translation computes an output eager differentiates from no input"]
        if reasons and writer.write(graph_like):
            _detach(captured.nodes)
            _forget_new(farm, cached)
            route.routed.append(f"{_label(target)}: {', '.join(dict.fromkeys(reasons))}")
            return
        graph_like.extend(captured.nodes)

    def lower_or_note(
        model: Any,
        node: torch.fx.Node,
        node_name_to_values: dict[str, Any],
        *,
        graph_like: Any,
        **rest: Any,
    ) -> None:
        try:
            lower(model, node, node_name_to_values, graph_like=graph_like, **rest)
        except Exception:
            # a decomposition's node (prims) that does not translate: its operator is kept
            # whole on the next translation when the executor runs it
            source = _canonical(node.meta.get("original_aten")) or _effect_source(node)
            if (
                source is not None
                and aten_executor.installed()
                and source is not _canonical(node.target)
                and source not in route.whole
                and _runnable(source)
            ):
                route.decomposed.add(source)
            raise

    lower_or_note.__wrapped__ = original  # type: ignore[attr-defined]
    return lower_or_note


def _effect_source(node: torch.fx.Node) -> Any:
    """The aten operator whose decomposition wrote ``node``, a ``with_effects`` node, or None.

    A decomposition may call an effectful operator: ``linalg_cholesky`` is ``linalg_cholesky_ex``
    then ``_linalg_check_errors(info)``, which raises on a matrix that is not positive definite;
    functionalized, it is ``with_effects(token, aten._linalg_check_errors, ...)``, threading an
    effect token through the graph, which the translator cannot lower (it has no notion of
    tokens). Dropping the check would turn eager's error into a silent result; kept whole, the
    decomposed operator is one ATen node and PyTorch runs it, check included. The node carries
    no ``original_aten``; its provenance (``from_node``, written by the decomposition's
    interpreter) names the node it was decomposed from, by its target's name."""
    if node.target is not torch.ops.higher_order.with_effects:
        return None
    for source in node.meta.get("from_node") or ():
        found = _aten_named(str(getattr(source, "target", "")))
        if found is not None:
            return found
    return None


def _aten_named(name: str) -> Any:
    """``torch.ops.aten.<op>.<overload>`` for its name ``aten.<op>.<overload>``, else None."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return _canonical(getattr(packet, parts[2], None)) if packet is not None else None


def _cause(err: BaseException) -> str:
    """The first line of the innermost cause (the translator wraps torch_lib's error)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _canonical(target: Any) -> Any:
    """``torch.ops.aten.<name>.<overload>`` itself for an aten OpOverload (a node's
    ``original_aten`` is a copy, which neither hashes nor compares equal to it), else None."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _routable(target: Any) -> bool:
    """Whether an FX node calling ``target`` may take the route: an ``aten`` operator, or a
    custom one (``torch.library.custom_op``: torch.export keeps it as one node, which the
    translator has no translation for; PyTorch runs it and its registered autograd)."""
    return isinstance(target, torch._ops.OpOverload) and (
        target.namespace == "aten" or _custom(target)
    )


def _custom(target: torch._ops.OpOverload) -> bool:
    # (``torch._library.utils.is_builtin``'s test, which is private)
    return target.namespace not in ("aten", "prim", "prims")


def _operator_name(target: torch._ops.OpOverload) -> str:
    """The ATen node's ``operator``: aten's without its namespace (as the TorchScript route
    writes it), a custom operator's qualified (``ns::name``, which the executor looks up)."""
    name = str(target._schema.name)
    return name if _custom(target) else name.split("::")[-1]


def _label(target: Any) -> str:
    return f"{target._schema.name}.{target._overloadname}"


def _runnable(target: Any) -> bool:
    try:
        op = aten_executor.aten_operator(target._schema.name, _overload(target))
    except UnsupportedAtenOperatorError:
        return False
    return all(r == "Tensor" for r in op.returns) or op.returns == ("Tensor[]",)


def _overload(target: Any) -> str:
    return "" if target._overloadname == "default" else str(target._overloadname)


# -- which translations the engine cannot train ------------------------------------------------


def _is_float(value: Any) -> bool:
    from onnxscript import ir  # noqa: PLC0415 - optional frontend

    return value.dtype in (
        ir.DataType.FLOAT,
        ir.DataType.DOUBLE,
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
    )


def _maybe_float(value: Any) -> bool:
    return value.dtype is None or _is_float(value)


def _float_inputs(node: torch.fx.Node, node_name_to_values: Mapping[str, Any]) -> set[Any]:
    """The ONNX values of ``node``'s float tensor inputs (the start of its float paths). A
    value the translator left untyped (the output of a torch_lib function it inlines later)
    counts by the FX node's traced dtype: ``cumsum`` of a ``where`` went unrouted, and the
    engine then had no CumSum gradient (OpInfo's ``masked.cumsum``)."""
    found: set[Any] = set()
    for source in node.all_input_nodes:
        value = node_name_to_values.get(source.name)
        values = value if isinstance(value, Sequence) else [value]
        traced = source.meta.get("val")
        traced_float = isinstance(traced, torch.Tensor) and traced.dtype.is_floating_point
        found.update(
            v
            for v in values
            if v is not None
            and hasattr(v, "dtype")
            and (_is_float(v) or (v.dtype is None and traced_float))
        )
    return found


def _cuts_gradient(
    node: torch.fx.Node, node_name_to_values: Mapping[str, Any], reached: set[Any]
) -> bool:
    """Whether the translation of ``node`` computes a float output from none of its float
    inputs (it is not in ``reached``: :func:`_reached`) where eager's
    autograd differentiates that output from them (with a zero gradient): ``angle`` of a real
    tensor (``Where(x < 0, pi, 0)``), ``fill`` (an ``Expand`` of the value to the input's
    shape). The engine then hands the output back without ``requires_grad`` and the inputs
    no gradient, where eager's are zeros; PyTorch runs such a node and its autograd."""
    value = node_name_to_values.get(node.name)
    values = list(value) if isinstance(value, Sequence) else [value]
    cut = [
        i
        for i, v in enumerate(values)
        if v is not None and hasattr(v, "dtype") and _is_float(v) and v not in reached
    ]
    if not cut:
        return False
    eager = _eager_requires_grad(node)
    return eager is not None and any(i < len(eager) and eager[i] for i in cut)


#: ONNX ops whose outputs carry no gradient whatever their inputs (comparisons, logic, sizes,
#: indices): the translator leaves their outputs untyped while it lowers
_NO_GRADIENT_OUTPUTS = frozenset(
    {
        *("Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal", "Not", "And", "Or"),
        *("Xor", "IsNaN", "IsInf", "Shape", "Size", "ArgMax", "ArgMin", "NonZero"),
        *("ConstantOfShape", "EyeLike", "RandomUniformLike", "RandomNormalLike", "Bernoulli"),
    }
)


#: ONNX op -> its inputs that carry no gradient to its outputs: CastLike reads only the type
#: of its second input (torch_lib writes ``CastLike(value, self)`` for every Python scalar)
_NO_GRADIENT_INPUTS = {"CastLike": (1,), "Where": (0,), "Expand": (1,), "Reshape": (1,)}


def _reached(
    nodes: Sequence[Any], start: set[Any], model: Any, gaps: list[str] | None = None
) -> set[Any]:
    """The values of ``nodes`` (one translation, in order) a gradient could flow to from
    ``start``: every output of a node reading one through an input that carries a gradient,
    except those of ops whose outputs carry none and those typed as not float. An untyped
    output counts as reached (the translator types few of a lowering's intermediate values),
    so a cut is claimed only where one is certain.

    ``gaps`` gets a reason for each ``Pow`` whose exponent is reached: the engine (1.19.2)
    differentiates Pow for its base only ("GradientBuilder is not implemented for ... Pow's
    input exponent"; ``pow(x, y)``, ``2 ** x``, ``exp2``, ``ldexp``), as the TorchScript
    frontend's ``aten/gradient_gaps.py`` finds. A constant exponent (``x ** 2``: a
    ``CastLike`` of the constant, which reads ``x`` only for its type) is not reached."""
    reached = set(start)
    for n in nodes:
        if (
            gaps is not None
            and n.op_type == "Pow"
            and n.domain in ("", "ai.onnx")
            and len(n.inputs) > 1
            and n.inputs[1] in reached
        ):
            gaps.append("Pow's exponent (the engine has no gradient for it)")
        if n.domain not in ("", "ai.onnx"):
            function = model.functions.get(n.op_identifier())
            if function is not None:
                # a call of a local function (torch_lib's scripted ones): looked into
                inner = {p for p, a in zip(function.inputs, n.inputs, strict=False) if a in reached}
                inside = _reached(list(function), inner, model, gaps)
                reached.update(
                    o for o, r in zip(n.outputs, function.outputs, strict=False) if r in inside
                )
                continue
            carrying = list(n.inputs)
        elif n.op_type in _NO_GRADIENT_OUTPUTS:
            continue
        else:
            skipped = _NO_GRADIENT_INPUTS.get(n.op_type, ())
            carrying = [v for i, v in enumerate(n.inputs) if i not in skipped]
        if any(v is not None and v in reached for v in carrying):
            reached.update(o for o in n.outputs if _maybe_float(o))
    return reached


def _eager_requires_grad(node: torch.fx.Node) -> list[bool] | None:
    """Whether each output of ``node``'s operator requires grad in eager when its float tensor
    arguments do: the operator run on meta tensors of the traced shapes (the FX node's values
    carry no ``requires_grad``); None where that cannot be run."""
    try:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _meta_argument)
        with torch.enable_grad():
            out = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # an operator without a meta kernel, an unknown size: no answer
        return None
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]


def _meta_argument(source: torch.fx.Node) -> Any:
    val = source.meta.get("val")
    if isinstance(val, torch.Tensor):
        made = torch.empty_strided(
            [_hint(s) for s in val.shape],
            [_hint(s) for s in val.stride()],
            dtype=val.dtype,
            device="meta",
        )
        return made.requires_grad_(val.dtype.is_floating_point or val.dtype.is_complex)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _hint(val)
    if isinstance(val, (int, float, bool)):
        return val
    raise TypeError(f"{source.name}: no value to run the operator on")


def _hint(size: Any) -> Any:
    """A concrete size for a symbolic one: its traced value (never a guard)."""
    if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = size.node.hint
        if hint is None:
            raise TypeError("a size without a traced value")
        return hint
    return size


def _untrainable(nodes: Sequence[Any], derived: set[Any], model: Any) -> list[str]:
    """Why the ONNX ``nodes`` (one translation, in order) cannot be trained: op types on a float
    path from ``derived`` that the engine has no gradient builder for, and control flow there
    (the engine's builder aborts on some If/Loop bodies). Calls of local functions (torch_lib's
    scripted ones) are looked into."""
    from onnxscript import ir  # noqa: PLC0415 - optional frontend

    graphs = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
    found: list[str] = []
    for n in nodes:
        if not any(v is not None and v in derived for v in n.inputs):
            continue
        if n.domain in ("", "ai.onnx"):
            if any(a.type in graphs for a in n.attributes.values()):
                found.append("control flow")
            elif (gap := _gradient_form_gap(n)) is not None:
                found.append(gap)
            elif n.op_type not in _REWRITTEN_AFTER_TRANSLATION and not engine_has_gradient(
                n.op_type, opset=_opset(model)
            ):
                found.append(f"no engine gradient for {n.op_type}")
            elif (gradient := _gradient_without_cpu_kernel(n.op_type)) is not None:
                found.append(f"the engine's gradient {gradient} has no CPU kernel")
            elif n.op_type in _WRONG_GRADIENTS:
                found.append(_WRONG_GRADIENTS[n.op_type])
        else:
            function = model.functions.get(n.op_identifier())
            if function is not None:
                inner = {p for p, a in zip(function.inputs, n.inputs, strict=False) if a in derived}
                found.extend(_untrainable(list(function), inner, model))
        derived.update(o for o in n.outputs if _maybe_float(o))
    return found


def _opset(model: Any) -> int:
    """The default domain's opset the translation writes (18 and newer): the engine is asked
    about that version of an op (Mish, new in 18, is unknown to an opset-17 probe)."""
    return int(model.opset_imports.get("", 18))


def _gradient_form_gap(node: Any) -> str | None:
    """Why the engine's gradient builder (1.19.2) refuses this form of an ONNX node whose op
    type it has a builder for, or None. The graph fixes (``torch_export_fixes``) rewrite the
    forms they can (a Slice with a negative step, ReduceL2, an integer Pow exponent); these
    they cannot, so the operator runs in PyTorch, as on the TorchScript frontend
    (``aten/gradient_gaps.py``):

    * ``Pad`` in ``edge``/``reflect``/``wrap`` mode (``pad(mode="replicate")``, ``"reflect"``,
      ``"circular"``): "Pad gradient currently supports constant mode only".
    """
    if node.op_type == "Pad":
        mode = node.attributes.get("mode")
        value = mode.value if mode is not None else "constant"
        if value != "constant":
            return f"Pad mode={value} (the engine's gradient is for constant mode only)"
    return None


#: ONNX ops whose engine gradient (1.19.2) is wrong where torch_lib writes them, and why
_WRONG_GRADIENTS = {
    # the CPU AveragePoolGrad sizes its output from the node's static output shape, which has
    # no value for a dynamic dim: the input's gradient came back of shape [0, 0, 0] for a
    # [2, 3, 9] input (avg_pool1d), and it ignores ceil_mode. The TorchScript frontend writes
    # a window-sum Conv instead (symbolics.pooling._avg_pool)
    "AveragePool": "the engine's AveragePoolGrad sizes its output from static shapes",
}

#: op -> the engine's gradient operator for it (domain, type, its input count), where the
#: engine's CPU build may have the gradient builder but no kernel for what it writes
_GRADIENT_OPERATORS = {
    # 1.19.2: ResizeGrad is a CUDA kernel only; the session refuses a CPU training graph of
    # Resize ("Could not find an implementation for ResizeGrad(1)": interpolate nearest, whose
    # torch_lib lowering is Resize; the TorchScript frontend writes Gathers, symbolics.upsampling)
    "Resize": ("com.microsoft", "ResizeGrad", 2),
    # ConvTransposeGrad is CUDA-only too ("Could not find an implementation for
    # ConvTransposeGrad(1)": conv_transpose1d/2d/3d)
    "ConvTranspose": ("com.microsoft", "ConvTransposeGrad", 3),
}


def _gradient_without_cpu_kernel(op_type: str) -> str | None:
    """The engine's gradient operator of ``op_type`` when its CPU build cannot run it (asked of
    the engine), else None. The route then runs the operator in PyTorch on every device: a
    CUDA engine would have the kernel, but the export does not know where the graph runs."""
    gradient = _GRADIENT_OPERATORS.get(op_type)
    if gradient is None:
        return None
    domain, name, count = gradient
    floats = (onnx.TensorProto.FLOAT,) * count
    return None if cpu_kernel_exists(name, floats, domain=domain) else name


def _forget_new(farm: dict[Any, Any], cached: set[Any]) -> None:
    for key in [k for k in farm if k not in cached]:
        del farm[key]


def _detach(nodes: Sequence[Any]) -> None:
    """Drop the uses that ``nodes`` (not added to any graph) hold on their inputs."""
    for n in nodes:
        for i in range(len(n.inputs)):
            n.replace_input_with(i, None)


# -- the ATen node -------------------------------------------------------------------------------


class _NotRunnable(Exception):
    """An argument the ATen executor cannot be handed."""


class _AtenWriter:
    """Writes one FX node as an ATen node (and the constants it reads)."""

    def __init__(
        self,
        core: Any,
        node: torch.fx.Node,
        node_name_to_values: dict[str, Any],
        local_functions: dict[str, Any],
        route: AtenRoute,
    ) -> None:
        self.route = route
        self.core = core
        self.node = node
        self.values = node_name_to_values
        self.local_functions = local_functions
        self.extra: list[Any] = []

    def write(self, graph_like: Any) -> bool:
        """Add the ATen node for the FX node to ``graph_like`` and map its outputs; False (and
        nothing written) when the executor cannot run it."""
        from onnxscript import ir  # noqa: PLC0415 - optional frontend

        node, target = self.node, self.node.target
        assert isinstance(target, torch._ops.OpOverload)
        self.extra = []
        try:
            op = aten_executor.aten_operator(target._schema.name, _overload(target))
            if any(i is None for i in self._inputs_of_nodes()):
                raise _NotRunnable("an input has no ONNX value")
            if not (all(r == "Tensor" for r in op.returns) or op.returns == ("Tensor[]",)):
                raise _NotRunnable(f"it returns {op.returns}")
            meta = node.meta.get("val")
            if op.returns == ("Tensor[]",):
                if not isinstance(meta, (list, tuple)):
                    raise _NotRunnable("the length of its list is not known")
                count = len(meta)
            else:
                count = len(op.returns)
            inputs = [self._input(arg, self._argument(i, arg)) for i, arg in enumerate(op.args)]
        except (_NotRunnable, UnsupportedAtenOperatorError) as err:
            logger.debug("aten::%s cannot take the ATen route: %s", target, err)
            return False
        aten = ir.Node(
            ATEN_DOMAIN,
            "ATen",
            inputs,
            [ir.AttrString("operator", _operator_name(op.op)),
             ir.AttrString("overload_name", op.overload)],
            num_outputs=count,
        )  # fmt: skip
        outputs = list(aten.outputs)
        many = count != 1 or op.returns == ("Tensor[]",)
        # named and typed as the translator names and types a lowering's outputs
        if many:
            metas = meta if isinstance(meta, (list, tuple)) else (meta,)
            for value, value_meta in zip(outputs, metas, strict=False):
                if isinstance(value_meta, torch.Tensor):
                    self.core._set_shape_type(value, value_meta, complex_to_float=True)
            for i, value in enumerate(outputs):
                value.name = f"{node.name}__{i}"
            self.values[node.name] = outputs
            aten.name = f"node_{node.name}__0"
        else:
            if isinstance(meta, torch.Tensor):
                self.core._set_shape_type(outputs[0], meta, complex_to_float=True)
            outputs[0].name = node.name
            self.values[node.name] = outputs[0]
            aten.name = f"node_{node.name}"
        added_for(self.core, node, [*self.extra, aten], graph_like)
        self.route.written.append((aten, len(inputs)))
        return True

    def _inputs_of_nodes(self) -> list[Any]:
        return [self.values.get(n.name) for n in self.node.all_input_nodes]

    _MISSING = object()

    def _argument(self, index: int, arg: Any) -> Any:
        node = self.node
        if not arg.kwarg_only and index < len(node.args):
            return node.args[index]
        return node.kwargs.get(arg.name, self._MISSING)

    def _value(self, fx_node: torch.fx.Node) -> Any:
        value = one_value(self.core, fx_node, self.values, self.local_functions)
        if value is None:
            raise _NotRunnable(f"{fx_node.name} is not one ONNX value")
        return value

    def _constant(self, array: np.ndarray) -> Any:
        made, out = constant(array)
        self.extra.append(made)
        return out

    def _ints(self, items: Sequence[Any], dtype: Any) -> Any:
        """A 1-D tensor of ``items``; SymInts among them are graph values (Concat of them)."""
        from onnxscript import ir  # noqa: PLC0415 - optional frontend

        if not any(isinstance(v, torch.fx.Node) for v in items):
            return self._constant(np.array(list(items), dtype=dtype))
        shape = self._constant(np.array([1], dtype=np.int64))
        parts = []
        for item in items:
            if isinstance(item, torch.fx.Node):
                reshape = ir.Node("", "Reshape", (self._value(item), shape))
                self.extra.append(reshape)
                parts.append(reshape.outputs[0])
            else:
                parts.append(self._constant(np.array([item], dtype=dtype)))
        concat = ir.Node("", "Concat", parts, [ir.AttrInt64("axis", 0)])
        self.extra.append(concat)
        return concat.outputs[0]

    def _input(self, arg: Any, value: Any) -> Any:
        """The ONNX input for schema argument ``arg`` given ``value`` (None: empty, which the
        executor reads as the argument's default)."""
        from onnxscript import ir  # noqa: PLC0415 - optional frontend

        kind = arg.kind
        if value is self._MISSING and kind in ("int", "float", "bool") and arg.default is not None:
            # a default the translator's retrace left out, written as the TorchScript route
            # writes it: gradient definitions and passes read these inputs (flash attention's
            # dropout_p and is_causal)
            value = arg.default
        if value is self._MISSING or value is None:
            if value is self._MISSING and not (arg.optional or arg.has_default):
                raise _NotRunnable(f"argument {arg.name} is missing")
            if value is None and not (arg.optional or kind == "Tensor" or arg.has_default):
                raise _NotRunnable(f"argument {arg.name} is None")
            return None
        if isinstance(value, torch.fx.Node):
            if kind in ("Tensor", "int", "float", "bool", "Scalar"):
                return self._value(value)
            raise _NotRunnable(f"argument {arg.name} ({kind}) is computed")
        if kind == "Tensor[]":
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, torch.fx.Node) for v in value
            ):
                raise _NotRunnable(f"argument {arg.name} is not a list of tensors")
            sequence = ir.Node("", "SequenceConstruct", [self._value(v) for v in value])
            self.extra.append(sequence)
            return sequence.outputs[0]
        if kind in ("ScalarType", "int") and isinstance(value, torch.dtype):
            # the executor's schema reads a ScalarType argument as an int (its code)
            code = int(type_utils.JitScalarType.from_dtype(value))  # type: ignore[call-overload]
            return self._constant(np.array(code, dtype=np.int64))
        if kind in ("int", "float", "bool", "Scalar") and isinstance(value, (bool, int, float)):
            if isinstance(value, bool):
                return self._constant(np.array(value, dtype=np.bool_))
            if isinstance(value, int):
                return self._constant(np.array(value, dtype=np.int64))
            return self._constant(np.array(value, dtype=np.float64))
        if kind in ("int[]", "float[]", "bool[]"):
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            dtype = {"int[]": np.int64, "float[]": np.float64, "bool[]": np.bool_}[kind]
            return self._ints(items, dtype)
        if kind == "str" and isinstance(value, str):
            made = ir.Node("", "Constant", (), [ir.AttrString("value_string", value)])
            self.extra.append(made)
            return made.outputs[0]
        if kind == "other" and arg.has_default and value == arg.default:
            return None
        raise _NotRunnable(f"argument {arg.name} ({kind}) = {value!r}")
