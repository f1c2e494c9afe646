"""Operators exported as ``org.pytorch.aten::ATen`` nodes, which PyTorch runs inside the engine.

Three routes lead there:

* symbolics for operators the engine cannot train well from their ONNX export: ``embedding``
  with ``padding_idx`` or ``scale_grad_by_freq`` (the ONNX Gather gradient updates the padding
  row), einsum on CPU in other dtypes than float32, antialiased bicubic/bilinear resampling (no
  ONNX symbolic), any operator given to :func:`register_aten_route`, and
  ``scaled_dot_product_attention`` (``ORTMODULE_ATEN_SDPA_FALLBACK=1`` or
  ``ORTMODULE_USE_EFFICIENT_ATTENTION=1``: PyTorch's fused attention kernels);
* any operator with no ONNX symbolic at all, when the export runs with
  ``operator_export_type=ONNX_ATEN_FALLBACK``: the exporter writes an ATen node for it and
  the ATen pass (:func:`ortmodule_exporter.passes.aten_nodes.prepare_aten_nodes`) makes it
  trainable (as a PythonOp running :class:`~ortmodule_exporter.aten.aten_op.AtenOp` when no
  gradient definition exists), so one unsupported operator no longer sends the whole model
  back to PyTorch;
* ``ORTMODULE_ATEN_DROPOUT=1`` exports training-mode ``dropout`` as PyTorch's
  ``native_dropout``, so the mask is drawn by PyTorch's generator as eager draws it, and its
  gradient reuses that mask (``native_dropout_backward``);
* ``ORTMODULE_USE_EFFICIENT_ATTENTION=1`` also fuses the unfused attention pattern
  ``Softmax(Q @ K^T * scale [+ mask]) @ V`` into PyTorch's attention kernel
  (:mod:`ortmodule_exporter.passes.attention_fusion`).

>>> from ortmodule_exporter.aten.routes import configure_aten_routes
>>> configure_aten_routes(sdpa_fallback=True)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.onnx import symbolic_helper as sh

from ..active_export import active_export_config
from ..symbolics.registry import (
    LayerSymbolic,
    SymbolicEntry,
    over_below,
    register_symbolic,
    register_symbolic_layer,
    torch_symbolic,
)
from . import executor as aten_executor
from .engine_gradients import engine_has_gradient
from .executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from .overloads import operator_name, resolve_fallback_overloads, resolve_overload

__all__ = [
    "DEFAULT_ROUTES",
    "EINSUM",
    "TRACED_TYPES",
    "aten_routes",
    "configure_aten_routes",
    "operator_export_type",
    "register_aten_route",
    "register_untrainable_check",
    "traced_constant",
    "traced_requires_grad",
    "untrainable_nodes",
    "untrainable_ops_routed",
]

logger = logging.getLogger("ortmodule.exporter")

#: our einsum operator; its overload_name is the equation (a string cannot be a node input)
EINSUM = "_ortmodule_einsum"


@dataclass
class _Routes:
    sdpa_fallback: bool = False
    efficient_attention: bool = False
    embedding: bool = False
    dropout: bool = False


#: the process defaults, which an export without a config uses (``ExportConfig.from_switches``)
_ROUTES = _Routes()


def aten_routes() -> _Routes:
    """The routes of the export running in this context, else the process defaults."""
    active = active_export_config()
    if active is None:
        return _ROUTES
    return _Routes(
        sdpa_fallback=bool(active.aten_sdpa_fallback),
        efficient_attention=bool(active.efficient_attention),
        embedding=bool(active.aten_embedding),
        dropout=bool(active.aten_dropout),
    )


def configure_aten_routes(
    sdpa_fallback: bool = False,
    efficient_attention: bool = False,
    embedding: bool = False,
    dropout: bool = False,
) -> None:
    """Set the process defaults of the routes (an export given an ``ExportConfig`` uses its own):
    ``sdpa_fallback``/``efficient_attention`` route attention, ``embedding`` routes embeddings
    with ``padding_idx``/``scale_grad_by_freq`` (by default
    :mod:`ortmodule_exporter.symbolics.embedding` exports those as ONNX, which the engine trains
    exactly), ``dropout`` routes training-mode dropout to PyTorch's kernel (eager's masks).

    Each routing symbolic hands the cases it does not route to the symbolic below it in the
    export's table (:func:`ortmodule_exporter.symbolics.registry.symbolic_table`).
    """
    _ROUTES.sdpa_fallback = bool(sdpa_fallback)
    _ROUTES.efficient_attention = bool(efficient_attention)
    _ROUTES.embedding = bool(embedding)
    _ROUTES.dropout = bool(dropout)


def _whole(op: str) -> Callable[[SymbolicEntry | None], Any]:
    """A route that takes every call of ``op`` (nothing is handed to the entry below)."""

    def make(below: SymbolicEntry | None) -> Any:
        return _route(op)

    return make


def _routes_layer(config: Any) -> Iterator[LayerSymbolic]:
    """The symbolics the routes put on an export's table for ``config``."""
    yield LayerSymbolic("aten::einsum", over_below(_einsum, torch_symbolic(12, "einsum")), 12)
    for op in DEFAULT_ROUTES:
        yield LayerSymbolic(op, _whole(op), 9)
    if config.aten_embedding:
        embedding = over_below(_embedding, torch_symbolic(9, "embedding"))
        yield LayerSymbolic("aten::embedding", embedding, 9)
    if config.aten_sdpa_fallback or config.efficient_attention:
        sdpa = over_below(_sdpa, torch_symbolic(14, "scaled_dot_product_attention"))
        yield LayerSymbolic("aten::scaled_dot_product_attention", sdpa, 14)
    if config.aten_dropout:
        for op in _DROPOUT_OPS:
            yield LayerSymbolic(op, over_below(_dropout, torch_symbolic(12, "dropout")), 12)


def operator_export_type() -> torch.onnx.OperatorExportTypes:
    """What ``torch.onnx.export`` should use: ``ONNX_ATEN_FALLBACK`` once the ATen executor is
    installed (an operator without symbolic then becomes an ATen node), else plain ``ONNX``."""
    if aten_executor.installed():
        return torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK
    return torch.onnx.OperatorExportTypes.ONNX


# -- helpers for symbolics -----------------------------------------------------------------------


def _const(g: Any, value: Any, dtype: torch.dtype | None = None) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _none(g: Any) -> Any:
    value = g.op("prim::Constant")
    value.setType(torch._C.NoneType.get())
    return value


def traced_sizes(value: Any) -> list[int | None] | None:
    """A traced tensor's sizes (None where unknown), or None when they are not known at all."""
    try:
        sizes = value.type().varyingSizes()
    except (AttributeError, RuntimeError):
        return None
    return list(sizes) if sizes is not None else None


def traced_constant(value: Any) -> torch.Tensor | None:
    """The tensor a traced value is a constant of (through Casts; an integer constant as a 0-d
    tensor), or None when it is computed."""
    node = value.node()
    while node.kind() == "onnx::Cast":
        node = node.inputsAt(0).node()
    if node.kind() not in ("onnx::Constant", "prim::Constant") or not node.hasAttribute("value"):
        return None
    kind = node.kindOf("value")
    if kind == "t":
        return node.t("value")
    if kind == "i":
        return torch.tensor(node.i("value"))
    return None


def _device(value: Any) -> Any:
    jit_type: Any = value.type()
    return jit_type.device() if hasattr(jit_type, "device") else None


def _typed(
    value: Any, like: Any, sizes: Sequence[int | None] | None, dtype: torch.dtype | None = None
) -> Any:
    """Give an ATen node's output the dtype of ``like`` and ``sizes`` (None: a dynamic dim)."""
    base = like.type()
    if dtype is not None:
        base = base.with_dtype(dtype)
    value.setType(base.with_sizes(list(sizes)) if sizes is not None else base)
    return value


def _aten(
    g: Any, operator: str, inputs: Sequence[Any], overload: str = "", outputs: int = 1
) -> Any:
    return g.op(
        f"{ATEN_DOMAIN}::ATen",
        *inputs,
        operator_s=operator,
        overload_name_s=overload,
        outputs=outputs,
    )


# -- embedding -------------------------------------------------------------------------------------


def _embedding(
    default: Any,
    g: Any,
    weight: Any,
    indices: Any,
    padding_idx: Any,
    scale_grad_by_freq: Any,
    sparse: Any,
) -> Any:
    padding = sh._maybe_get_const(padding_idx, "i")
    by_freq = sh._maybe_get_const(scale_grad_by_freq, "b")
    if (
        not isinstance(padding, int)
        or not isinstance(by_freq, (bool, int))
        or (padding < 0 and not by_freq)
    ):
        return default(g, weight, indices, padding_idx, scale_grad_by_freq, sparse)
    return embedding_node(g, weight, indices, padding, bool(by_freq))


def embedding_node(
    g: Any, weight: Any, indices: Any, padding: int, by_freq: bool, index_rank: int | None = None
) -> Any:
    """An ATen ``embedding`` node (PyTorch's lookup forward, ``embedding_backward`` backward);
    ``index_rank``: the indices' rank where the graph does not know it (the result's rank is
    one more, which the engine's gradient builders need)."""
    out = _aten(
        g,
        "embedding",
        [weight, indices, _const(g, padding), _const(g, by_freq), _const(g, False)],
    )
    index_sizes, weight_sizes = traced_sizes(indices), traced_sizes(weight)
    sizes = None
    if index_sizes is None and index_rank is not None:
        index_sizes = [None] * index_rank
    if index_sizes is not None and weight_sizes is not None and len(weight_sizes) == 2:
        sizes = [*index_sizes, weight_sizes[1]]
    return _typed(out, weight, sizes)


# -- dropout -----------------------------------------------------------------------------------

#: the traced forms of ``F.dropout`` / ``nn.Dropout`` (``inplace=True`` traces as ``dropout_``)
_DROPOUT_OPS = ("aten::dropout", "aten::dropout_")


def _dropout(default: Any, g: Any, x: Any, p: Any, train: Any) -> Any:
    """Training-mode dropout as PyTorch's ``native_dropout``: the engine calls PyTorch, which
    draws the mask from its own generator exactly as eager's ``dropout`` does (same draws, same
    generator state after), and the gradient is ``native_dropout_backward`` of that mask.

    Eager draws nothing for p = 0 (the input comes back) nor for p = 1, and ``native_dropout``
    would draw, shifting every later draw of the step: p = 0 returns the input, p = 1 and
    anything not constant keep the ONNX export.
    """
    rate = sh._maybe_get_const(p, "f")
    training = sh._maybe_get_const(train, "b")
    if not isinstance(training, (bool, int)) or not isinstance(rate, float):
        return default(g, x, p, train)
    if not training or rate == 0.0:
        return x
    if not 0.0 < rate < 1.0:
        return default(g, x, p, train)
    return native_dropout_node(g, x, rate)


def native_dropout_node(g: Any, x: Any, rate: float) -> Any:
    """An ATen ``native_dropout`` node (training mode, 0 < ``rate`` < 1): its output."""
    out, mask = _aten(
        g,
        "native_dropout",
        [x, _const(g, rate, torch.float), _const(g, True)],
        outputs=2,
    )
    sizes = traced_sizes(x)
    _typed(mask, x, sizes, torch.bool)
    return _typed(out, x, sizes)


# -- operators routed whole ----------------------------------------------------------------------

#: operators we always route to ATen: antialiased resampling (no ONNX symbolic; plain bicubic
#: and bilinear export to ONNX Resize, which the engine trains), and operators whose ONNX form
#: the engine differentiates silently wrong: scatter_add (ScatterElements(reduction=add) gives
#: ``self`` a gradient of 0 instead of 1 at the scattered positions), native_layer_norm (the
#: LayerNormalization gradient ignores gradients reaching its mean and rstd outputs), and
#: log_sigmoid, whose ONNX form Log(Sigmoid(x)) loses precision where x > 0 (the log of a float
#: near 1: 1.5e-4 off in multilabel_soft_margin_loss); ONNX has no log1p for the stable form.
#: multinomial: ONNX Multinomial takes rank 2 only and draws from the engine's generator, so
#: PyTorch's draws it from PyTorch's generator, the same samples as eager after the same seed
DEFAULT_ROUTES = (
    "aten::_upsample_bicubic2d_aa",
    "aten::_upsample_bilinear2d_aa",
    "aten::scatter_add",
    "aten::native_layer_norm",
    "aten::log_sigmoid",
    "aten::multinomial",
)


def _route(op: str, overload: str | None = None) -> Any:
    name = op.split("::", 1)[1]

    def symbolic(g: Any, *args: Any) -> Any:
        node = g.original_node
        chosen = _aten_overload(node) if overload is None else overload
        outs = _aten(g, name, args, overload=chosen, outputs=node.outputsSize())
        values = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for value, original in zip(values, node.outputs(), strict=True):
            rank = original.type().dim() if hasattr(original.type(), "dim") else None
            value.setType(
                original.type().with_sizes([None] * rank) if rank is not None else original.type()
            )
        return values[0] if len(values) == 1 else tuple(values)

    return symbolic


def _overload_for(name: str, node: Any) -> str:
    """The overload of a traced ``aten::name`` call (traced nodes carry no schema, and scalar
    arguments are tensors by now): the one the executor picks for that many arguments."""
    try:
        return aten_executor.aten_operator(name, "", node.inputsSize()).overload
    except aten_executor.UnsupportedAtenOperatorError:
        return ""


def register_aten_route(op: str) -> None:
    """Export ``op`` (``"aten::name"``) as an ATen node that PyTorch runs, whatever its symbolic.

    >>> register_aten_route("aten::_upsample_bicubic2d_aa")
    """
    if not op.startswith("aten::"):
        raise ValueError(f"register_aten_route takes an aten:: operator, got {op!r}")
    register_symbolic(op, _route(op), 9)


# -- operators whose ONNX form the engine cannot differentiate ----------------------------------

#: value types that carry a gradient
_FLOAT_SCALARS = frozenset({"Float", "Double", "Half", "BFloat16"})


def _is_float(value: Any) -> bool:
    """A float tensor, or a list built from one (``torch.hstack([x, y])``)."""
    try:
        if value.type().scalarType() in _FLOAT_SCALARS:
            return True
    except (AttributeError, RuntimeError):
        pass
    producer = value.node()
    return producer.kind() in ("onnx::SequenceConstruct", "prim::ListConstruct") and any(
        _is_float(v) for v in producer.inputs()
    )


def untrainable_nodes(inputs: Sequence[Any], nodes: Sequence[Any]) -> list[str]:
    """ONNX op types among ``nodes`` (what one symbolic emitted, in order) that sit on a float
    path from ``inputs`` and that the engine cannot train: no gradient builder (asked of the
    engine itself), an axis into a 0-d tensor, or a MatMul by a vector."""
    derived = {v.unique() for v in inputs if v is not None and _is_float(v)}
    found: list[str] = []
    for node in nodes:
        if not any(i.unique() in derived for i in node.inputs()):
            continue
        kind = node.kind()
        op_type = kind.split("::", 1)[1]
        if kind.startswith("onnx::") and not engine_has_gradient(op_type):
            found.append(op_type)
        elif op_type in _AXIS_OPS and _rank(next(iter(node.inputs()), None)) == 0:
            found.append(f"{op_type} on a 0-d tensor")
        elif op_type == "MatMul" and _rank(list(node.inputs())[-1]) == 1:
            # the engine's MatMul gradient (FusedMatMul, Reshape) fails when the right operand
            # is a vector (1-D @ 1-D, matrix @ vector); vector @ matrix trains
            found.append("MatMul by a vector")
        derived.update(o.unique() for o in node.outputs() if maybe_float(o))
    return found


def maybe_float(value: Any) -> bool:
    """Float, or of a type the exporter has not inferred (a path is kept until proven int)."""
    try:
        scalar = value.type().scalarType()
    except (AttributeError, RuntimeError):
        return True
    return scalar is None or scalar in _FLOAT_SCALARS


#: ONNX operators whose axis must index a dimension: PyTorch accepts dim=0 (or -1) on a 0-d
#: tensor, the engine's shape inference rejects it
_AXIS_OPS = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "Hardmax",
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSumExp",
        "ReduceSumSquare",
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


def _rank(value: Any) -> int | None:
    if value is None:
        return None
    try:
        rank = value.type().dim()
    except (AttributeError, RuntimeError):
        return None
    return int(rank) if rank is not None else None


def _aten_overload(node: Any) -> str:
    """The overload a traced node calls, from the kinds of its inputs (aten_overloads: its
    schema may be an out= variant or the wrong one of index_fill.int_Tensor/int_Scalar); from
    its schema, or by argument count, when none fits."""
    resolved = resolve_overload(operator_name(node.kind()), node)
    if resolved is not None:
        return resolved
    try:
        schema = node.schema()
    except RuntimeError:
        schema = "(no schema)"
    if schema == "(no schema)":
        return _overload_for(operator_name(node.kind()), node)
    if not schema.startswith("aten::"):
        return ""
    return str(torch._C.parse_schema(schema).overload_name)


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
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    bad = untrainable_nodes(inputs, emitted)
    for check in _CHECKS:
        bad.extend(check(node, inputs, emitted))
    if any(list(n.blocks()) for n in emitted) and any(
        i is not None and _is_float(i) for i in inputs
    ):
        # the engine's gradient builder aborts the process on some If/Loop subgraphs
        # (diagonal, hstack): control flow over a float input is never handed to it
        bad.append("control flow")
    if not GLOBALS.export_training:
        # an inference graph needs no gradient, only shapes the engine accepts
        bad = [b for b in bad if b.endswith("tensor")]
    return bad


#: attribute of an exported ATen node: its outputs' traced types, ``"elem:rank,..."`` (ONNX
#: element type, "" where unknown). The ATen pass reads and removes it
#: (:func:`ortmodule_exporter.passes.aten_nodes.prepare_aten_nodes`): torch writes no
#: value_info, and the meta kernels the pass otherwise types outputs with reject calls the CPU
#: kernel runs (``_grouped_mm``'s wants bfloat16), which left the node untyped, hence neither
#: routed to a PythonOp nor differentiable by the engine.
TRACED_TYPES = "_ortmodule_traced_types"


def _traced_type(value: Any) -> str:
    """``"elem:rank"`` of a traced value ("" when its dtype or rank is unknown)."""
    from torch.onnx._internal.torchscript_exporter import _type_utils

    if value.type().kind() != "TensorType":  # a list (dsplit) or a scalar: no tensor type
        return ""
    undefined = _type_utils.JitScalarType.UNDEFINED
    scalar = _type_utils.JitScalarType.from_value(value, undefined)
    rank = _rank(value)
    if scalar == undefined or rank is None:
        return ""
    return f"{int(scalar.onnx_type())}:{rank}"  # type: ignore[call-overload]


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
            overload = _aten_overload(node) if kind.startswith("aten::") else ""
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
            overload = _aten_overload(node)
            if not _runnable_by_executor(name, overload, node) or any(i is None for i in inputs):
                return result
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

        # nodes inside If/Loop bodies go with their owner; the rest are destroyed users first
        nested = {_key(inner) for n in new_nodes[mark:] for inner in _inner_nodes(n)}
        for created in reversed(new_nodes[mark:]):
            if _key(created) not in nested:
                created.destroy()
        del new_nodes[mark:]
        from torch.onnx._internal.torchscript_exporter import jit_utils
        from torch.onnx._internal.torchscript_exporter import utils as export_utils

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
        return _route(f"aten::{name}", overload)(g, *inputs)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def untrainable_ops_routed() -> Iterator[None]:
    """For one export: operators whose ONNX form the engine cannot train become ATen nodes."""
    from torch.onnx._internal.torchscript_exporter import utils as export_utils

    original = export_utils._run_symbolic_function
    export_utils._run_symbolic_function = _route_untrainable(original)
    try:
        yield
    finally:
        export_utils._run_symbolic_function = original


# -- einsum ----------------------------------------------------------------------------------------


def einsum_needs_aten(dtypes: Sequence[str | None], device: Any) -> bool:
    """Einsums the engine cannot train from ONNX: on CPU, anything but float32 (its Einsum
    gradient lowers to FusedMatMul, which has no float64/float16 CPU kernel)."""
    on_cpu = device is None or device.type == "cpu"
    return on_cpu and any(d not in ("Float", None) for d in dtypes)


def _einsum(default: Any, g: Any, equation: Any, tensor_list: Any, *rest: Any) -> Any:
    eq = sh._maybe_get_const(equation, "s")
    tensors = sh._unpack_list(tensor_list)
    dtypes = [t.type().scalarType() for t in tensors]
    device = _device(tensors[0]) if tensors else None
    if not isinstance(eq, str) or not einsum_needs_aten(dtypes, device):
        return default(g, equation, tensor_list, *rest)
    out = _aten(g, EINSUM, tensors, overload=eq)
    rank = _einsum_rank(eq, [traced_sizes(t) for t in tensors])
    return _typed(out, tensors[0], [None] * rank if rank is not None else None)


def _einsum_rank(equation: str, sizes: list[list[int | None] | None]) -> int | None:
    eq = equation.replace(" ", "")
    if "->" not in eq or "..." in eq:
        return None
    return len(eq.split("->")[1])


def _run_einsum(equation: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [torch.einsum(equation, *inputs)]


register_aten_function(EINSUM, AtenFunction(_run_einsum, lambda _eq, _i, _is_input: True))

#: above our own symbolics and the PythonOp export, below the kernel choice (which wraps what
#: the routes leave to ONNX)
register_symbolic_layer("aten_routes", _routes_layer, order=20)


# -- scaled dot product attention -------------------------------------------------------------------


def _sdpa(
    default_symbolic: Any,
    g: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: Any = None,
    is_causal: Any = None,
    scale: Any = None,
    enable_gqa: Any = None,
) -> Any:
    def default() -> Any:
        return default_symbolic(
            g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )

    dropout = 0.0 if dropout_p is None else sh._maybe_get_const(dropout_p, "f")
    causal = False if is_causal is None else sh._maybe_get_const(is_causal, "b")
    gqa = (
        False
        if enable_gqa is None or sh._is_none(enable_gqa)
        else sh._maybe_get_const(enable_gqa, "b")
    )
    scale_value = None if scale is None or sh._is_none(scale) else sh._maybe_get_const(scale, "f")
    q_sizes, v_sizes = traced_sizes(query), traced_sizes(value)
    if (
        not isinstance(dropout, float)
        or dropout != 0.0
        or not isinstance(causal, (bool, int))
        or gqa
        or (scale_value is not None and not isinstance(scale_value, float))
        or q_sizes is None
        or v_sizes is None
        or len(q_sizes) != 4
        or len(v_sizes) != 4
    ):
        return default()
    device = _device(query)
    mask = attn_mask
    if mask is not None and not sh._is_none(mask) and traced_requires_grad(mask):
        # the fused kernels' backward gives the mask no gradient: a learned bias stays decomposed
        return default()
    if mask is not None and not sh._is_none(mask):
        if mask.type().scalarType() == "Bool":
            # the fused kernels take an additive float mask
            zero = _const(g, 0.0, torch.float32)
            neg_inf = _const(g, float("-inf"), torch.float32)
            mask = g.op("Where", mask, zero, neg_inf)
            dtype = query.type().scalarType()
            if dtype != "Float":
                from torch.onnx._internal.torchscript_exporter import _type_utils

                mask = g.op(
                    "Cast", mask, to_i=_type_utils.JitScalarType._from_name(dtype).onnx_type()
                )
    else:
        mask = _none(g)
    scale_input = _none(g) if scale_value is None else _const(g, float(scale_value), torch.float64)
    out_sizes = [*q_sizes[:3], v_sizes[3]]
    if device is not None and device.type == "cuda":
        outs = _aten(
            g,
            "_scaled_dot_product_efficient_attention",
            [
                query,
                key,
                value,
                mask,
                _const(g, True),
                _const(g, 0.0, torch.float64),
                _const(g, bool(causal)),
                scale_input,
            ],
            outputs=4,
        )
    else:
        outs = _aten(
            g,
            "_scaled_dot_product_flash_attention_for_cpu",
            [
                query,
                key,
                value,
                _const(g, 0.0, torch.float64),
                _const(g, bool(causal)),
                mask,
                scale_input,
            ],
            outputs=2,
        )
    _typed(outs[1], query, None, torch.float32)
    return _typed(outs[0], query, out_sizes)


def traced_requires_grad(value: Any) -> bool:
    """Whether the traced value depends on something that requires grad (unknown: True)."""
    value_type = value.type()
    requires = getattr(value_type, "requires_grad", None)
    if requires is None:
        return True
    found = requires()
    return True if found is None else bool(found)
