"""Operators whose ONNX form the engine cannot train, routed to ATen nodes during the export.

:func:`untrainable_ops_routed` wraps torch's per-node symbolic dispatch for one export: when the
ONNX nodes a symbolic emitted hold one the engine cannot differentiate (no gradient builder, an
axis into a 0-d tensor, a MatMul by a vector, control flow over a float input, or a reason a
:func:`register_untrainable_check` gives), the traced operator becomes one ATen node that
PyTorch runs and differentiates. Every ATen node records its traced output types
(:data:`TRACED_TYPES`).

>>> from ortmodule_exporter.aten.untrainable import untrainable_ops_routed
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import onnx_graph
from ..torchscript_onnx import GLOBALS, export_utils, jit_utils, type_utils
from . import executor as aten_executor
from .engine_gradients import engine_has_gradient
from .executor import ATEN_DOMAIN
from .overloads import operator_name, resolve_fallback_overloads
from .routes import route_node
from .symbolic_helpers import is_float_value, maybe_float, traced_overload, traced_rank

__all__ = [
    "TRACED_TYPES",
    "register_untrainable_check",
    "untrainable_nodes",
    "untrainable_ops_routed",
]

logger = logging.getLogger("ortmodule.exporter")


def untrainable_nodes(inputs: Sequence[Any], nodes: Sequence[Any]) -> list[str]:
    """ONNX op types among ``nodes`` (what one symbolic emitted, in order) that sit on a float
    path from ``inputs`` and that the engine cannot train: no gradient builder (asked of the
    engine itself), an axis into a 0-d tensor, or a MatMul by a vector."""
    derived = {v.unique() for v in inputs if v is not None and is_float_value(v)}
    found: list[str] = []
    for node in nodes:
        if not any(i.unique() in derived for i in node.inputs()):
            continue
        kind = node.kind()
        op_type = kind.split("::", 1)[1]
        if kind.startswith("onnx::") and not engine_has_gradient(op_type):
            found.append(op_type)
        elif op_type in _AXIS_OPS and traced_rank(next(iter(node.inputs()), None)) == 0:
            found.append(f"{op_type} on a 0-d tensor")
        elif op_type == "MatMul" and traced_rank(list(node.inputs())[-1]) == 1:
            # the engine's MatMul gradient (FusedMatMul, Reshape) fails when the right operand
            # is a vector (1-D @ 1-D, matrix @ vector); vector @ matrix trains
            found.append("MatMul by a vector")
        derived.update(o.unique() for o in node.outputs() if maybe_float(o))
    return found


#: ONNX operators whose axis must index a dimension: PyTorch accepts dim=0 (or -1) on a 0-d
#: tensor, the engine's shape inference rejects it
_AXIS_OPS = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "Hardmax",
        *onnx_graph.REDUCTIONS,
        "TopK",
        "Gather",
        "GatherElements",
        "GatherND",
        "ArgMax",
        "ArgMin",
        "CumSum",
        "Concat",
        "Split",
        "ScatterElements",
    }
)


def _runnable_by_executor(name: str, overload: str, node: Any) -> bool:
    try:
        operator = aten_executor.aten_operator(name, overload, node.inputsSize())
    except aten_executor.UnsupportedAtenOperatorError:
        return False
    if len(operator.args) != node.inputsSize():
        return False
    # tensor lists reach it through a PythonOp (prepare_aten_nodes); other kinds cannot. A
    # returned list reaches the graph as its elements (passes.aten_nodes._unpack_list_outputs)
    return not any(a.kind == "other" for a in operator.args) and (
        all(r == "Tensor" for r in operator.returns) or operator.returns == ("Tensor[]",)
    )


def _key(node: Any) -> tuple[int, ...]:
    """A node's identity (pybind hands out a new wrapper object at every access)."""
    return tuple(o.unique() for o in node.outputs())


def _inner_nodes(node: Any) -> list[Any]:
    found = []
    for block in node.blocks():
        for inner in block.nodes():
            found.append(inner)
            found.extend(_inner_nodes(inner))
    return found


#: more reasons to route a node to ATen (see register_untrainable_check)
_CHECKS: list[Any] = []


def register_untrainable_check(check: Any) -> None:
    """Add ``check(node, inputs, emitted) -> list[str]``: reasons why the ONNX nodes
    ``emitted`` for the traced ``node`` (its ONNX ``inputs``) cannot be trained, each of which
    routes the operator to ATen. A reason ending in "tensor" (a shape property) applies to
    inference exports too, as the engine's forward kernels reject such shapes.

    >>> register_untrainable_check(lambda node, inputs, emitted: [])
    """
    if check not in _CHECKS:
        _CHECKS.append(check)


def _untrainable_reasons(node: Any, inputs: list[Any], emitted: list[Any]) -> list[str]:
    """Why the ONNX nodes ``emitted`` for ``node`` must not reach the engine ([]: they may)."""

    bad = untrainable_nodes(inputs, emitted)
    for check in _CHECKS:
        bad.extend(check(node, inputs, emitted))
    if any(list(n.blocks()) for n in emitted) and any(
        i is not None and is_float_value(i) for i in inputs
    ):
        # the engine's gradient builder aborts the process on some If/Loop subgraphs
        # (diagonal, hstack): control flow over a float input is never handed to it
        bad.append("control flow")
    if not GLOBALS.export_training:
        # an inference graph needs no gradient, only shapes the engine accepts
        bad = [b for b in bad if b.endswith("tensor")]
    return bad


#: attribute of an exported ATen node: its outputs' traced types, ``"elem:rank:sizes,..."``
#: (ONNX element type, rank, the traced sizes joined by ``x``; "" where unknown). The ATen pass reads and removes it
#: (:func:`ortmodule_exporter.passes.aten_nodes.prepare_aten_nodes`): torch writes no
#: value_info, and the meta kernels the pass otherwise types outputs with reject calls the CPU
#: kernel runs (``_grouped_mm``'s wants bfloat16), which left the node untyped, hence neither
#: routed to a PythonOp nor differentiable by the engine.
TRACED_TYPES = "_ortmodule_traced_types"


def _traced_type(value: Any) -> str:
    """``"elem:rank:sizes"`` of a traced value (sizes ``?`` when unknown; "" when its dtype or
    rank is unknown)."""

    if value.type().kind() != "TensorType":  # a list (dsplit) or a scalar: no tensor type
        return ""
    undefined = type_utils.JitScalarType.UNDEFINED
    scalar = type_utils.JitScalarType.from_value(value, undefined)
    rank = traced_rank(value)
    if scalar == undefined or rank is None:
        return ""
    sizes = value.type().sizes()
    traced = "x".join(str(int(n)) for n in sizes) if sizes is not None else "?"
    return f"{int(scalar.onnx_type())}:{rank}:{traced}"  # type: ignore[call-overload]


def _record_traced_types(node: Any, result: Any, created: Sequence[Any]) -> None:
    """Write :data:`TRACED_TYPES` on the ATen nodes in ``created`` that produce the values
    ``result`` stands for (the traced ``node``'s outputs)."""
    values = list(result) if isinstance(result, (list, tuple)) else [result]
    if result is None or len(values) != node.outputsSize():
        return
    traced = {v.unique(): o for v, o in zip(values, node.outputs(), strict=True) if v is not None}
    for made in created:
        if not made.kind().endswith("::ATen") or made.hasAttribute(TRACED_TYPES):
            continue
        types = [
            _traced_type(traced[o.unique()]) if o.unique() in traced else "" for o in made.outputs()
        ]
        if any(types):
            made.s_(TRACED_TYPES, ",".join(types))


def _route_untrainable(original: Any) -> Any:
    """Wrap torch's per-node symbolic dispatch: when the ONNX nodes a symbolic emitted hold one
    the engine cannot differentiate (CumSum, Floor, ReduceMax, ...) on a float path of a training
    export, replace them with one ATen node, which PyTorch runs and differentiates. Every ATen
    node a traced node turned into records that node's output types (:data:`TRACED_TYPES`)."""

    def run(
        graph: Any,
        block: Any,
        node: Any,
        inputs: Any,
        env: Any,
        values_in_env: Any,
        new_nodes: list[Any],
        operator_export_type: Any = torch.onnx.OperatorExportTypes.ONNX,
    ) -> Any:
        mark = len(new_nodes)
        result = dispatch(
            graph, block, node, inputs, env, values_in_env, new_nodes, operator_export_type
        )
        if node.kind().startswith("aten::"):
            _record_traced_types(node, result, new_nodes[mark:])
        return result

    def dispatch(
        graph: Any,
        block: Any,
        node: Any,
        inputs: Any,
        env: Any,
        values_in_env: Any,
        new_nodes: list[Any],
        operator_export_type: Any = torch.onnx.OperatorExportTypes.ONNX,
    ) -> Any:
        mark = len(new_nodes)
        kind = node.kind()
        try:
            result = original(
                graph, block, node, inputs, env, values_in_env, new_nodes, operator_export_type
            )
        except Exception as err:
            # a symbolic that cannot export this call (an unsupported argument, an unknown
            # shape) leaves the operator to PyTorch when the executor can run it
            name = operator_name(kind)
            overload = traced_overload(node) if kind.startswith("aten::") else ""
            if (
                operator_export_type != torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK
                or not kind.startswith("aten::")
                or not _runnable_by_executor(name, overload, node)
                or any(i is None for i in inputs)
            ):
                raise
            bad = [f"its symbolic failed ({err})"]
            result = None
        else:
            if kind.startswith("aten::"):
                resolve_fallback_overloads(node, new_nodes[mark:])
            outputs = list(result) if isinstance(result, (list, tuple)) else [result]
            short = result is not None and len(outputs) != node.outputsSize()
            if (
                operator_export_type != torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK
                or not kind.startswith("aten::")
                or result is None
                or (
                    not short
                    and any(
                        n.kind().startswith(("aten::", f"{ATEN_DOMAIN}::"))
                        for n in new_nodes[mark:]
                    )
                )
            ):
                return result
            bad = _untrainable_reasons(node, list(inputs), new_nodes[mark:])
            if short:
                # torch's own ATen node for adaptive_max_pool3d has one output, not two
                bad.append(f"its symbolic gave {len(outputs)} of {node.outputsSize()} outputs")
            if not bad:
                return result
            name = operator_name(kind)
            overload = traced_overload(node)
            if not _runnable_by_executor(name, overload, node) or any(i is None for i in inputs):
                return result

        # nodes inside If/Loop bodies go with their owner; the rest are destroyed users first
        nested = {_key(inner) for n in new_nodes[mark:] for inner in _inner_nodes(n)}
        for created in reversed(new_nodes[mark:]):
            if _key(created) not in nested:
                created.destroy()
        del new_nodes[mark:]

        g = jit_utils.GraphContext(
            graph=graph,
            block=block,
            opset=GLOBALS.export_onnx_opset_version,
            original_node=node,
            params_dict=export_utils._params_dict,
            env=env,
            values_in_env=values_in_env,
            new_nodes=new_nodes,
        )
        logger.debug("aten::%s runs in PyTorch: %s", name, bad)
        return route_node(f"aten::{name}", overload)(g, *inputs)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def untrainable_ops_routed() -> Iterator[None]:
    """For one export: operators whose ONNX form the engine cannot train become ATen nodes."""

    original = export_utils._run_symbolic_function
    export_utils._run_symbolic_function = _route_untrainable(original)
    try:
        yield
    finally:
        export_utils._run_symbolic_function = original
