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
  :func:`prepare_aten_nodes` makes it trainable (as a PythonOp running :class:`AtenOp` when no
  gradient definition exists), so one unsupported operator no longer sends the whole model
  back to PyTorch;
* ``ORTMODULE_USE_EFFICIENT_ATTENTION=1`` also fuses the unfused attention pattern
  ``Softmax(Q @ K^T * scale [+ mask]) @ V`` into PyTorch's attention kernel.

>>> from ortmodule_exporter.aten_fallback import configure_aten_routes
>>> configure_aten_routes(sdpa_fallback=True)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch
from torch.onnx import symbolic_helper as sh

from . import aten_executor
from .aten_executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from .aten_overloads import resolve_fallback_overloads
from .custom_gradients import has_gradient
from .onnx_graph import attribute
from .post_export import register_post_export_pass
from .symbolic_registry import register_symbolic, unregister_symbolic

__all__ = [
    "DEFAULT_ROUTES",
    "EINSUM",
    "AtenOp",
    "aten_routes",
    "configure_aten_routes",
    "export_settings",
    "fuse_attention",
    "operator_export_type",
    "prepare_aten_nodes",
    "register_aten_route",
    "register_untrainable_check",
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


_ROUTES = _Routes()


def aten_routes() -> _Routes:
    return _ROUTES


#: op -> the symbolic our registry held before ours (ortmodule_exporter.symbolics), which ours
#: hands every case it does not route to ATen
_PREVIOUS: dict[str, Any] = {}
_OURS: set[Any] = set()


def _install(op: str, fn: Any, opset: int) -> None:
    from .symbolic_registry import registered_symbolics

    current = registered_symbolics().get(op)
    if current is not None and current.fn not in _OURS:
        _PREVIOUS[op] = current
    _OURS.add(fn)
    register_symbolic(op, fn, opset)


def _uninstall(op: str) -> None:
    from .symbolic_registry import registered_symbolics

    current = registered_symbolics().get(op)
    if current is None or current.fn not in _OURS:
        return
    previous = _PREVIOUS.get(op)
    if previous is not None:
        register_symbolic(op, previous.fn, previous.opset)
    else:
        unregister_symbolic(op)


def _previous(op: str, default: Any) -> Any:
    entry = _PREVIOUS.get(op)
    return default if entry is None else entry.fn


def configure_aten_routes(
    sdpa_fallback: bool = False, efficient_attention: bool = False, embedding: bool = False
) -> None:
    """Install the ATen symbolics; ``sdpa_fallback``/``efficient_attention`` route attention,
    ``embedding`` routes embeddings with ``padding_idx``/``scale_grad_by_freq`` (by default
    :mod:`ortmodule_exporter.symbolics` exports those as ONNX, which the engine trains exactly).

    Each symbolic here hands the cases it does not route to the symbolic registered before it.
    They only apply to ORTModule's exports (see :mod:`ortmodule_exporter.symbolic_registry`).
    """
    _ROUTES.sdpa_fallback = bool(sdpa_fallback)
    _ROUTES.efficient_attention = bool(efficient_attention)
    _ROUTES.embedding = bool(embedding)
    _install("aten::einsum", _einsum, 12)
    for op in DEFAULT_ROUTES:
        register_aten_route(op)
    if embedding:
        _install("aten::embedding", _embedding, 9)
    else:
        _uninstall("aten::embedding")
    if sdpa_fallback or efficient_attention:
        _install("aten::scaled_dot_product_attention", _sdpa, 14)
    else:
        _uninstall("aten::scaled_dot_product_attention")


def operator_export_type() -> torch.onnx.OperatorExportTypes:
    """What ``torch.onnx.export`` should use: ``ONNX_ATEN_FALLBACK`` once the ATen executor is
    installed (an operator without symbolic then becomes an ATen node), else plain ``ONNX``."""
    if aten_executor.installed():
        return torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK
    return torch.onnx.OperatorExportTypes.ONNX


def export_settings() -> str:
    """The switches that change what the export writes, for export-cache keys."""
    r = _ROUTES
    return (
        f"aten_fallback={int(aten_executor.installed())},sdpa={int(r.sdpa_fallback)},"
        f"attention={int(r.efficient_attention)},embedding={int(r.embedding)}"
    )


# -- helpers for symbolics -----------------------------------------------------------------------


def _const(g: Any, value: Any, dtype: torch.dtype | None = None) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _none(g: Any) -> Any:
    value = g.op("prim::Constant")
    value.setType(torch._C.NoneType.get())
    return value


def _sizes(value: Any) -> list[int | None] | None:
    try:
        sizes = value.type().varyingSizes()
    except RuntimeError:
        return None
    return list(sizes) if sizes is not None else None


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
    g: Any, weight: Any, indices: Any, padding_idx: Any, scale_grad_by_freq: Any, sparse: Any
) -> Any:
    from torch.onnx._internal.torchscript_exporter import symbolic_opset9

    default = _previous("aten::embedding", symbolic_opset9.embedding)
    padding = sh._maybe_get_const(padding_idx, "i")
    by_freq = sh._maybe_get_const(scale_grad_by_freq, "b")
    if (
        not isinstance(padding, int)
        or not isinstance(by_freq, (bool, int))
        or (padding < 0 and not by_freq)
    ):
        return default(g, weight, indices, padding_idx, scale_grad_by_freq, sparse)
    out = _aten(
        g,
        "embedding",
        [weight, indices, _const(g, padding), _const(g, bool(by_freq)), _const(g, False)],
    )
    index_sizes, weight_sizes = _sizes(indices), _sizes(weight)
    sizes = None
    if index_sizes is not None and weight_sizes is not None and len(weight_sizes) == 2:
        sizes = [*index_sizes, weight_sizes[1]]
    return _typed(out, weight, sizes)


# -- operators routed whole ----------------------------------------------------------------------

#: operators we always route to ATen: antialiased resampling (no ONNX symbolic; plain bicubic
#: and bilinear export to ONNX Resize, which the engine trains), and operators whose ONNX form
#: the engine differentiates silently wrong: scatter_add (ScatterElements(reduction=add) gives
#: ``self`` a gradient of 0 instead of 1 at the scattered positions), native_layer_norm (the
#: LayerNormalization gradient ignores gradients reaching its mean and rstd outputs)
DEFAULT_ROUTES = (
    "aten::_upsample_bicubic2d_aa",
    "aten::_upsample_bilinear2d_aa",
    "aten::scatter_add",
    "aten::native_layer_norm",
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
    from .gradient_registry import engine_has_gradient

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
        derived.update(o.unique() for o in node.outputs() if _maybe_float(o))
    return found


def _maybe_float(value: Any) -> bool:
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
    from .aten_overloads import resolve_overload

    resolved = resolve_overload(node.kind().split("::", 1)[1].rstrip("_"), node)
    if resolved is not None:
        return resolved
    try:
        schema = node.schema()
    except RuntimeError:
        schema = "(no schema)"
    if schema == "(no schema)":
        return _overload_for(node.kind().split("::", 1)[1].rstrip("_"), node)
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
    # tensor lists reach it through a PythonOp (prepare_aten_nodes); other kinds cannot
    return not any(a.kind == "other" for a in operator.args) and all(
        r == "Tensor" for r in operator.returns
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
    if GLOBALS.training_mode != torch.onnx.TrainingMode.TRAINING:
        # an inference graph needs no gradient, only shapes the engine accepts
        bad = [b for b in bad if b.endswith("tensor")]
    return bad


def _route_untrainable(original: Any) -> Any:
    """Wrap torch's per-node symbolic dispatch: when the ONNX nodes a symbolic emitted hold one
    the engine cannot differentiate (CumSum, Floor, ReduceMax, ...) on a float path of a training
    export, replace them with one ATen node, which PyTorch runs and differentiates."""

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
        kind = node.kind()
        try:
            result = original(
                graph, block, node, inputs, env, values_in_env, new_nodes, operator_export_type
            )
        except Exception as err:
            # a symbolic that cannot export this call (an unsupported argument, an unknown
            # shape) leaves the operator to PyTorch when the executor can run it
            name = kind.split("::", 1)[1].rstrip("_")
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
            name = kind.split("::", 1)[1].rstrip("_")
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


def _einsum(g: Any, equation: Any, tensor_list: Any, *rest: Any) -> Any:
    from torch.onnx._internal.torchscript_exporter import symbolic_opset12

    eq = sh._maybe_get_const(equation, "s")
    tensors = sh._unpack_list(tensor_list)
    dtypes = [t.type().scalarType() for t in tensors]
    device = _device(tensors[0]) if tensors else None
    if not isinstance(eq, str) or not einsum_needs_aten(dtypes, device):
        return _previous("aten::einsum", symbolic_opset12.einsum)(g, equation, tensor_list, *rest)
    out = _aten(g, EINSUM, tensors, overload=eq)
    rank = _einsum_rank(eq, [_sizes(t) for t in tensors])
    return _typed(out, tensors[0], [None] * rank if rank is not None else None)


def _einsum_rank(equation: str, sizes: list[list[int | None] | None]) -> int | None:
    eq = equation.replace(" ", "")
    if "->" not in eq or "..." in eq:
        return None
    return len(eq.split("->")[1])


def _run_einsum(equation: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [torch.einsum(equation, *inputs)]


register_aten_function(EINSUM, AtenFunction(_run_einsum, lambda _eq, _i, _is_input: True))


# -- scaled dot product attention -------------------------------------------------------------------


def _sdpa(
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
    from torch.onnx._internal.torchscript_exporter import symbolic_opset14

    def default() -> Any:
        fn = _previous(
            "aten::scaled_dot_product_attention", symbolic_opset14.scaled_dot_product_attention
        )
        return fn(g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    dropout = 0.0 if dropout_p is None else sh._maybe_get_const(dropout_p, "f")
    causal = False if is_causal is None else sh._maybe_get_const(is_causal, "b")
    gqa = (
        False
        if enable_gqa is None or sh._is_none(enable_gqa)
        else sh._maybe_get_const(enable_gqa, "b")
    )
    scale_value = None if scale is None or sh._is_none(scale) else sh._maybe_get_const(scale, "f")
    q_sizes, v_sizes = _sizes(query), _sizes(value)
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
    if mask is not None and not sh._is_none(mask) and _requires_grad(mask):
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


def _requires_grad(value: Any) -> bool:
    """Whether the traced value depends on something that requires grad (unknown: True)."""
    value_type = value.type()
    requires = getattr(value_type, "requires_grad", None)
    if requires is None:
        return True
    found = requires()
    return True if found is None else bool(found)


# -- the post-export pass over ATen nodes -------------------------------------------------------------


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = a.t.data_type
    return types


_FLOATS = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
}


def _known(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None] | None]]:
    """name -> (elem_type, dims or None) for every value ONNX shape inference can type."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - types are filled best effort
        inferred = model
    graph = inferred.graph
    known: dict[str, tuple[int, list[int | None] | None]] = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not t.elem_type:
            continue
        dims = None
        if t.HasField("shape"):
            dims = [int(d.dim_value) if d.HasField("dim_value") else None for d in t.shape.dim]
        known[vi.name] = (t.elem_type, dims)
    for init in graph.initializer:
        known[init.name] = (init.data_type, list(init.dims))
    return known


def _constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    values[node.output[0]] = onnx.numpy_helper.to_array(a.t)
    return values


def _output_types(
    node: onnx.NodeProto,
    known: Mapping[str, tuple[int, list[int | None] | None]],
    constants: Mapping[str, np.ndarray],
    strings: Mapping[str, str] | None = None,
    sequences: Mapping[str, list[str]] | None = None,
) -> list[tuple[int, int | None]] | None:
    """(elem_type, rank) of each output of an ATen node, found by running its operator on
    PyTorch's meta device (no data, no compute); None when that is not possible."""
    from onnx.helper import tensor_dtype_to_np_dtype

    operator = attribute(node, "operator", "")
    overload = attribute(node, "overload_name", "") or ""
    strings = strings or {}
    sequences = sequences or {}

    def meta(name: str) -> torch.Tensor | None:
        if name in constants:
            return torch.from_numpy(np.array(constants[name]))
        if name in known:
            elem_type, dims = known[name]
            dtype = torch.from_numpy(np.zeros(0, dtype=tensor_dtype_to_np_dtype(elem_type))).dtype
            shape = [d if d else 2 for d in dims] if dims is not None else [2]
            return torch.empty(shape, dtype=dtype, device="meta")
        return None

    inputs: list[Any] = []
    for name in node.input:
        if not name:
            inputs.append(None)
        elif name in strings:
            inputs.append(strings[name])
        elif name in sequences:
            members = [meta(m) for m in sequences[name]]
            if any(m is None for m in members):
                return None
            inputs.append(members)
        else:
            value = meta(name)
            if value is None:
                return None
            inputs.append(value)
    try:
        with torch.no_grad():
            results = aten_executor.execute(operator, overload, inputs)
    except Exception:  # noqa: BLE001
        return None
    types: list[tuple[int, int | None]] = []
    for r in results:
        if r is None:
            types.append((onnx.TensorProto.FLOAT, None))
            continue
        np_dtype = torch.empty(0, dtype=r.dtype).numpy().dtype
        types.append((onnx.helper.np_dtype_to_tensor_dtype(np_dtype), r.dim()))
    return types


def _type_aten_outputs(model: onnx.ModelProto) -> None:
    """Declare the element type (and rank) of ATen outputs the exporter left untyped: the
    engine cannot infer them, an ATen node's outputs may be of any type."""
    graph = model.graph
    # The engine turns graph outputs into inputs of its Yield node and keeps only value_info
    # types there, so an ATen node's graph output needs a value_info entry too.
    in_value_info = {vi.name for vi in graph.value_info}
    for vi in graph.output:
        producer = next((n for n in graph.node if vi.name in n.output), None)
        if (
            producer is not None
            and producer.domain == ATEN_DOMAIN
            and vi.type.tensor_type.elem_type
        ):
            if vi.name not in in_value_info:
                graph.value_info.append(vi)
    declared = {
        vi.name for vi in (*graph.value_info, *graph.output) if vi.type.tensor_type.elem_type
    }
    todo = [
        n
        for n in graph.node
        if n.domain == ATEN_DOMAIN and any(o and o not in declared for o in n.output)
    ]
    if not todo:
        return
    constants = _constant_values(graph)
    strings, sequences = _string_constants(graph), _sequence_inputs(graph)
    known = _known(model)
    for node in todo:
        if any(name and name not in known and name not in constants for name in node.input):
            known = _known(model)
        types = _output_types(node, known, constants, strings, sequences)
        if types is None:
            logger.warning(
                "could not type the outputs of ATen node %s; the engine may refuse it", node.name
            )
            continue
        for name, (elem_type, rank) in zip(node.output, types, strict=False):
            if not name or name in declared:
                continue
            shape = [None] * rank if rank is not None else None
            graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, shape))
            declared.add(name)
            known[name] = (elem_type, [None] * rank if rank is not None else None)
        for vi in graph.output:  # a graph output produced by the node: fill its type in place
            if vi.name in node.output and not vi.type.tensor_type.elem_type:
                vi.type.tensor_type.elem_type = types[list(node.output).index(vi.name)][0]


def _grouped(inputs: list[Any], groups: str) -> list[Any]:
    """Pack the tensors of list arguments back into lists: ``groups`` is ``"start:count,..."``
    over ``inputs`` (a list argument reaches the PythonOp as its tensors, one input each)."""
    if not groups:
        return inputs
    packed: list[Any] = []
    position = 0
    for group in groups.split(","):
        start, count = (int(v) for v in group.split(":"))
        packed.extend(inputs[position:start])
        packed.append(list(inputs[start : start + count]))
        position = start + count
    packed.extend(inputs[position:])
    return packed


class AtenOp(torch.autograd.Function):
    """A PyTorch operator with no ONNX form, run by the engine as a PythonOp during training.

    ``spec`` is ``"operator|overload"``. Forward calls the operator (with autograd recording for
    the inputs whose gradient the engine needs); backward is autograd's. The engine's PythonOp
    backward asks, per node, which inputs need a gradient, which a static ATen gradient
    definition cannot (see :mod:`ortmodule_exporter.custom_gradients`).
    """

    @staticmethod
    def forward(ctx: Any, spec: str, *inputs: Any) -> tuple[Any, ...]:
        operator, _, rest = spec.partition("|")
        overload, _, groups = rest.partition("|")
        needs = tuple(getattr(ctx, "needs_input_grad", ()))[1:] or (False,) * len(inputs)
        leaves = list(inputs)
        with torch.enable_grad():
            for i, t in enumerate(inputs):
                if needs[i] and isinstance(t, torch.Tensor) and t.is_floating_point():
                    leaves[i] = t.detach().requires_grad_(True)
            try:
                outputs = aten_executor.execute(operator, overload, _grouped(leaves, groups))
            except Exception as err:
                if hasattr(err, "add_note"):
                    err.add_note(f"raised by aten::{operator}.{overload or 'default'}")
                raise
        ctx.set_materialize_grads(False)
        ctx.leaves, ctx.results = leaves, outputs
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        leaves, results = ctx.leaves, ctx.results
        ctx.leaves = ctx.results = None
        pairs = [
            (o, g)
            for o, g in zip(results, grads, strict=False)
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
        ]
        wanted = [
            i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        gradients: list[Any] = [None] * len(leaves)
        if pairs and wanted:
            computed = torch.autograd.grad(
                [o for o, _ in pairs],
                [leaves[i] for i in wanted],
                [g for _, g in pairs],
                allow_unused=True,
            )
            for i, g in zip(wanted, computed, strict=True):
                gradients[i] = _materialized(g)
        return (None, *gradients)


def _materialized(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient the engine can read: autograd may return a ZeroTensor (no storage: sgn's
    gradient) or an empty tensor with any strides, both of which crash a DLPack reader."""
    if grad is None:
        return None
    if grad._is_zerotensor() or grad.numel() == 0:
        return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
    return grad if grad.is_contiguous() else grad.contiguous()


def _as_python_op(
    node: onnx.NodeProto,
    types: Mapping[str, int],
    ranks: Mapping[str, int | None],
    training: bool,
    strings: Mapping[str, str] | None = None,
    sequences: Mapping[str, list[str]] | None = None,
) -> list[onnx.NodeProto]:
    """``node`` (an ATen node) as a PythonOp running :class:`AtenOp`, plus casts of bool outputs.

    ``strings``: inputs that are string constants (passed as Python strings); ``sequences``:
    inputs that are ``SequenceConstruct`` outputs (passed as their tensors, packed back into a
    list by :class:`AtenOp`)."""
    strings = strings or {}
    sequences = sequences or {}
    from . import python_op, python_op_runner

    python_op_runner.install()  # the node needs the PythonOp runners
    entry = python_op.REGISTRY.register(AtenOp)
    operator = attribute(node, "operator", "")
    overload = attribute(node, "overload_name", "") or ""
    pointers: list[int] = []
    positions = [0]
    convention = "c"
    tensors, input_types, input_ranks = [], [], []
    groups: list[str] = []
    position = 1
    for name in node.input:
        if not name or name in strings:
            # a missing optional argument, or a string (the engine has no string tensors)
            convention += "c"
            pointers.append(python_op.REGISTRY.keep(strings.get(name)))
            positions.append(position)
            position += 1
            continue
        members = sequences.get(name, [name])
        if name in sequences:
            groups.append(f"{position - 1}:{len(members)}")
        for member in members:
            convention += "d"
            elem = types.get(member, onnx.TensorProto.FLOAT)
            if elem == onnx.TensorProto.BOOL:
                entry.bool_inputs.add(position)
            tensors.append(member)
            input_types.append(elem)
            input_ranks.append(ranks.get(member) or 0)
            position += 1
    spec = f"{operator}|{overload}" + (f"|{','.join(groups)}" if groups else "")
    pointers.insert(0, python_op.REGISTRY.keep(spec))
    tag = node.name or f"aten_{operator}_{id(node)}"
    outputs: list[str] = [f"{tag}_ctx"]
    output_types: list[int] = []
    output_ranks: list[int] = []
    casts: list[onnx.NodeProto] = []
    for name in node.output:
        elem = types.get(name, onnx.TensorProto.FLOAT)
        output_ranks.append(ranks.get(name) or 0)
        if elem == onnx.TensorProto.BOOL:
            raw = f"{name}__uint8"
            casts.append(onnx.helper.make_node("Cast", [raw], [name], to=onnx.TensorProto.BOOL))
            outputs.append(raw)
            output_types.append(onnx.TensorProto.UINT8)
        else:
            outputs.append(name)
            output_types.append(elem)
    op = python_op.python_op_node(
        entry,
        tensors,
        outputs,
        name=tag,
        convention=convention,
        types=(input_types, output_types),
        ranks=(input_ranks, output_ranks),
        training=training,
        scalars={"pointer": (pointers, positions)},
        comment=f"aten::{operator}.{overload or 'default'}",
    )
    return [op, *casts]


def _string_constants(graph: onnx.GraphProto) -> dict[str, str]:
    """Constant values that are one string (an ATen node's ``reduce="amax"`` and the like)."""
    found = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.type == onnx.AttributeProto.STRING:  # torch writes value= as a string
                    found[node.output[0]] = a.s.decode()
                elif a.name == "value" and a.t.data_type == onnx.TensorProto.STRING:
                    values = list(a.t.string_data)
                    if len(values) == 1:
                        found[node.output[0]] = values[0].decode()
    return found


def _sequence_inputs(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """``SequenceConstruct`` outputs read by ATen nodes -> the tensors they hold."""
    read = {name for n in graph.node if n.domain == ATEN_DOMAIN for name in n.input}
    return {
        n.output[0]: list(n.input)
        for n in graph.node
        if n.op_type == "SequenceConstruct" and n.output[0] in read
    }


def prepare_aten_nodes(model: onnx.ModelProto, training: bool = True) -> int:
    """Make every ATen node of ``model`` runnable and trainable; returns how many there are.

    * ``org.pytorch.aten::<op>`` nodes (what the exporter writes when a symbolic gives up under
      ``ONNX_ATEN_FALLBACK``) become ``ATen(operator=<op>)``, and their outputs get types;
    * in a training graph, a differentiable node whose operator has no gradient definition
      (:mod:`ortmodule_exporter.custom_gradients`) becomes a PythonOp running :class:`AtenOp`;
    * bool inputs are recorded for the executor (the engine hands bool tensors over as uint8)
      and bool outputs are cast back from the uint8 the executor returns.
    """
    graph = model.graph
    for node in graph.node:
        if node.domain == ATEN_DOMAIN and node.op_type != "ATen":
            operator = node.op_type
            node.op_type = "ATen"
            del node.attribute[:]
            node.attribute.extend(
                [
                    onnx.helper.make_attribute("operator", operator),
                    onnx.helper.make_attribute("overload_name", ""),
                ]
            )
    if not any(n.domain == ATEN_DOMAIN for n in graph.node):
        return 0
    _type_aten_outputs(model)
    known = _known(model)
    types = {**{name: elem for name, (elem, _dims) in known.items()}, **_value_types(model)}
    ranks = {name: (len(dims) if dims is not None else None) for name, (_t, dims) in known.items()}
    count = 0
    nodes: list[onnx.NodeProto] = []
    strings, sequences = _string_constants(graph), _sequence_inputs(graph)
    for node in graph.node:
        if node.domain != ATEN_DOMAIN:
            nodes.append(node)
            continue
        count += 1
        operator = attribute(node, "operator", "")
        overload = attribute(node, "overload_name", "") or ""
        internal = operator.startswith("_ortmodule_") and operator != EINSUM
        float_out = any(name and types.get(name) in _FLOATS for name in node.output)
        elements = [m for name in node.input for m in sequences.get(name, [name])]
        float_in = any(name and types.get(name) in _FLOATS for name in elements)
        # the engine's ATen kernel passes tensors only: strings and lists go through a PythonOp
        untensored = any(name in strings or name in sequences for name in node.input)
        if not internal and (
            untensored
            or (training and float_out and float_in and not has_gradient(operator, overload))
        ):
            nodes.extend(_as_python_op(node, types, ranks, training, strings, sequences))
            continue
        bools = {
            i
            for i, name in enumerate(node.input)
            if name and types.get(name) == onnx.TensorProto.BOOL
        }
        if bools:
            aten_executor.BOOL_INPUTS.setdefault((operator, overload), set()).update(bools)
        nodes.append(node)
        for slot, name in enumerate(node.output):
            if name and types.get(name) == onnx.TensorProto.BOOL:
                raw = f"{name}__uint8"
                node.output[slot] = raw
                nodes.append(onnx.helper.make_node("Cast", [raw], [name], to=onnx.TensorProto.BOOL))
                # the engine cannot infer an ATen output's type: declare the raw one
                rank = ranks.get(name)
                graph.value_info.append(
                    onnx.helper.make_tensor_value_info(
                        raw, onnx.TensorProto.UINT8, [None] * rank if rank is not None else None
                    )
                )
    used = {name for n in nodes for name in n.input} | {o.name for o in graph.output}
    # lists and strings now reach the PythonOps directly; the engine has no use for them
    nodes = [
        n
        for n in nodes
        if not (n.op_type == "SequenceConstruct" or n.output[0] in strings)
        or any(o in used for o in n.output)
    ]
    del graph.node[:]
    graph.node.extend(nodes)
    from .python_op import PYTHON_OP_DOMAIN

    if any(n.domain == PYTHON_OP_DOMAIN for n in nodes) and not any(
        o.domain == PYTHON_OP_DOMAIN for o in model.opset_import
    ):
        model.opset_import.append(onnx.helper.make_opsetid(PYTHON_OP_DOMAIN, 1))
    return count


def _aten_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    prepare_aten_nodes(exported.model, exported.training)


# -- attention fusion (ORTMODULE_USE_EFFICIENT_ATTENTION) ---------------------------------------------


def _scalar_constant(
    graph: onnx.GraphProto, name: str, producers: Mapping[str, onnx.NodeProto]
) -> float | None:
    node = producers.get(name)
    array = None
    if node is not None and node.op_type == "Constant":
        for a in node.attribute:
            if a.name == "value":
                array = onnx.numpy_helper.to_array(a.t)
    else:
        for init in graph.initializer:
            if init.name == name:
                array = onnx.numpy_helper.to_array(init)
    if array is None or array.size != 1:
        return None
    return float(np.asarray(array).reshape(-1)[0])


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001
        return {}
    ranks = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    return ranks


def fuse_attention(model: onnx.ModelProto) -> int:
    """Replace ``MatMul(Softmax(MatMul(Q, Transpose(K)) {*,/} c [+ mask]), V)`` on 4-D tensors
    with PyTorch's fused attention (an ATen node); returns how many were fused."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    ranks = _ranks(model)

    def single_use(name: str) -> bool:
        return len(consumers.get(name, [])) == 1 and name not in outputs

    fused = 0
    removed: set[int] = set()
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        probs, v = node.input
        softmax = producers.get(probs)
        if softmax is None or softmax.op_type != "Softmax" or not single_use(probs):
            continue
        axis = attribute(softmax, "axis", -1)
        if axis not in (-1, 3):
            continue
        chain = [softmax]
        scores = softmax.input[0]
        mask = ""
        step = producers.get(scores)
        if step is not None and step.op_type == "Add" and single_use(scores):
            chain.append(step)
            left, right = step.input
            left_node = producers.get(left)
            if left_node is not None and left_node.op_type in ("Mul", "Div", "MatMul"):
                scores, mask = left, right
            else:
                scores, mask = right, left
            step = producers.get(scores)
        scale = 1.0
        if step is not None and step.op_type in ("Mul", "Div") and single_use(scores):
            c = _scalar_constant(graph, step.input[1], producers)
            if c is None or c == 0.0:
                continue
            scale = c if step.op_type == "Mul" else 1.0 / c
            chain.append(step)
            scores = step.input[0]
            step = producers.get(scores)
        if step is None or step.op_type != "MatMul" or not single_use(scores):
            continue
        chain.append(step)
        q, kt = step.input
        transpose = producers.get(kt)
        if transpose is None or transpose.op_type != "Transpose" or not single_use(kt):
            continue
        if list(attribute(transpose, "perm", [])) != [0, 1, 3, 2]:
            continue
        chain.append(transpose)
        k = transpose.input[0]
        if any(ranks.get(x) != 4 for x in (q, k, v)):
            continue
        tag = f"fused_attention_{fused}"
        scale_name = f"{tag}_scale"
        constants = [
            onnx.helper.make_node(
                "Constant",
                [],
                [f"{tag}_dropout"],
                value=onnx.numpy_helper.from_array(np.array(0.0)),
            ),
            onnx.helper.make_node(
                "Constant",
                [],
                [f"{tag}_causal"],
                value=onnx.numpy_helper.from_array(np.array(False)),
            ),
            onnx.helper.make_node(
                "Constant", [], [scale_name], value=onnx.numpy_helper.from_array(np.array(scale))
            ),
        ]
        attention = onnx.helper.make_node(
            "ATen",
            [q, k, v, f"{tag}_dropout", f"{tag}_causal", mask, scale_name],
            [node.output[0], f"{tag}_logsumexp"],
            name=tag,
            domain=ATEN_DOMAIN,
            operator="_scaled_dot_product_flash_attention_for_cpu",
            overload_name="",
        )
        position = list(graph.node).index(node)
        for extra in reversed([*constants, attention]):
            graph.node.insert(position, extra)
        dead = {id(n) for n in [*chain, node]}
        removed |= dead
        fused += 1
    if fused:
        keep = [n for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(keep)
        if not any(o.domain == ATEN_DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(ATEN_DOMAIN, 1))
    return fused


def _attention_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    if exported.config.efficient_attention:
        n = fuse_attention(exported.model)
        if n:
            logger.info("fused %d attention pattern(s) into PyTorch's attention kernel", n)


register_post_export_pass("aten_efficient_attention", _attention_pass, order=30)
register_post_export_pass("aten_nodes", _aten_pass, order=40)
