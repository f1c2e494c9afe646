"""Operators exported as ``org.pytorch.aten::ATen`` nodes, which PyTorch runs inside the engine.

These routes lead there:

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
* operators whose ONNX form the engine cannot train (:mod:`ortmodule_exporter.aten.untrainable`);
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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..active_export import active_export_config
from ..symbolics.registry import (
    LayerSymbolic,
    SymbolicEntry,
    over_below,
    register_symbolic,
    register_symbolic_layer,
    registered_symbolics,
    torch_symbolic,
)
from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import type_utils
from . import executor as aten_executor
from .executor import AtenFunction, register_aten_function
from .symbolic_helpers import (
    aten_node,
    const_node,
    none_value,
    traced_device,
    traced_overload,
    traced_requires_grad,
    traced_sizes,
    typed_like,
)

__all__ = [
    "DEFAULT_ROUTES",
    "EINSUM",
    "aten_routes",
    "configure_aten_routes",
    "embedding_node",
    "native_dropout_node",
    "operator_export_type",
    "register_aten_route",
    "registered_aten_routes",
    "route_node",
]

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
        return route_node(op)

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
    out = aten_node(
        g,
        "embedding",
        [weight, indices, const_node(g, padding), const_node(g, by_freq), const_node(g, False)],
    )
    index_sizes, weight_sizes = traced_sizes(indices), traced_sizes(weight)
    sizes = None
    if index_sizes is None and index_rank is not None:
        index_sizes = [None] * index_rank
    if index_sizes is not None and weight_sizes is not None and len(weight_sizes) == 2:
        sizes = [*index_sizes, weight_sizes[1]]
    return typed_like(out, weight, sizes)


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
    out, mask = aten_node(
        g,
        "native_dropout",
        [x, const_node(g, rate, torch.float), const_node(g, True)],
        outputs=2,
    )
    sizes = traced_sizes(x)
    typed_like(mask, x, sizes, torch.bool)
    return typed_like(out, x, sizes)


# -- operators routed whole ----------------------------------------------------------------------

#: operators we always route to ATen: antialiased resampling (no ONNX symbolic; plain bicubic
#: and bilinear export to ONNX Resize, which the engine trains), and operators whose ONNX form
#: the engine differentiates silently wrong: scatter_add (ScatterElements(reduction=add) gives
#: ``self`` a gradient of 0 instead of 1 at the scattered positions), native_layer_norm (the
#: LayerNormalization gradient ignores gradients reaching its mean and rstd outputs), and
#: log_sigmoid, whose ONNX form Log(Sigmoid(x)) loses precision where x > 0 (the log of a float
#: near 1: 1.5e-4 off in multilabel_soft_margin_loss); ONNX has no log1p for the stable form.
#: multinomial: ONNX Multinomial takes rank 2 only and draws from the engine's generator, so
#: PyTorch's draws it from PyTorch's generator, the same samples as eager after the same seed.
#: binary_cross_entropy_with_logits: its ONNX form takes Log(Sigmoid(x)) and Log(1 - Sigmoid(x)),
#: -inf from |x| of about 17 on, and the gradient came back NaN where eager's is finite
#: (``x = -30``); PyTorch's kernel is the stable one (torch_export decomposes it stably).
DEFAULT_ROUTES = (
    "aten::_upsample_bicubic2d_aa",
    "aten::_upsample_bilinear2d_aa",
    "aten::scatter_add",
    "aten::native_layer_norm",
    "aten::log_sigmoid",
    "aten::multinomial",
    "aten::binary_cross_entropy_with_logits",
)


def route_node(op: str, overload: str | None = None) -> Any:
    name = op.split("::", 1)[1]

    def symbolic(g: Any, *args: Any) -> Any:
        node = g.original_node
        chosen = traced_overload(node) if overload is None else overload
        outs = aten_node(g, name, args, overload=chosen, outputs=node.outputsSize())
        values = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for value, original in zip(values, node.outputs(), strict=True):
            rank = original.type().dim() if hasattr(original.type(), "dim") else None
            value.setType(
                original.type().with_sizes([None] * rank) if rank is not None else original.type()
            )
        return values[0] if len(values) == 1 else tuple(values)

    return symbolic


def register_aten_route(op: str) -> None:
    """Export ``op`` (``"aten::name"``) as an ATen node that PyTorch runs, whatever its symbolic
    (on the torch_export frontend, whatever its translation: :func:`registered_aten_routes`).

    >>> register_aten_route("aten::_upsample_bicubic2d_aa")
    """
    if not op.startswith("aten::"):
        raise ValueError(f"register_aten_route takes an aten:: operator, got {op!r}")
    symbolic = route_node(op)
    symbolic._ortmodule_aten_route = True  # registered_aten_routes finds it by this mark
    register_symbolic(op, symbolic, 9)


def registered_aten_routes() -> frozenset[str]:
    """The operators (``"aten::name"``) :func:`register_aten_route` sends to PyTorch, as the
    symbolic registry holds them now (``unregister_symbolic`` takes one back)."""
    return frozenset(
        op
        for op, entry in registered_symbolics().items()
        if getattr(entry.fn, "_ortmodule_aten_route", False)
    )


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
    device = traced_device(tensors[0]) if tensors else None
    if not isinstance(eq, str) or not einsum_needs_aten(dtypes, device):
        return default(g, equation, tensor_list, *rest)
    out = aten_node(g, EINSUM, tensors, overload=eq)
    rank = _einsum_rank(eq, [traced_sizes(t) for t in tensors])
    return typed_like(out, tensors[0], [None] * rank if rank is not None else None)


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
    device = traced_device(query)
    mask = attn_mask
    if mask is not None and not sh._is_none(mask) and traced_requires_grad(mask):
        # the fused kernels' backward gives the mask no gradient: a learned bias stays decomposed
        return default()
    if mask is not None and not sh._is_none(mask):
        if mask.type().scalarType() == "Bool":
            # the fused kernels take an additive float mask
            zero = const_node(g, 0.0, torch.float32)
            neg_inf = const_node(g, float("-inf"), torch.float32)
            mask = g.op("Where", mask, zero, neg_inf)
            dtype = query.type().scalarType()
            if dtype != "Float":
                mask = g.op(
                    "Cast", mask, to_i=type_utils.JitScalarType._from_name(dtype).onnx_type()
                )
    else:
        mask = none_value(g)
    scale_input = (
        none_value(g) if scale_value is None else const_node(g, float(scale_value), torch.float64)
    )
    out_sizes = [*q_sizes[:3], v_sizes[3]]
    if device is not None and device.type == "cuda":
        outs = aten_node(
            g,
            "_scaled_dot_product_efficient_attention",
            [
                query,
                key,
                value,
                mask,
                const_node(g, True),
                const_node(g, 0.0, torch.float64),
                const_node(g, bool(causal)),
                scale_input,
            ],
            outputs=4,
        )
    else:
        outs = aten_node(
            g,
            "_scaled_dot_product_flash_attention_for_cpu",
            [
                query,
                key,
                value,
                const_node(g, 0.0, torch.float64),
                const_node(g, bool(causal)),
                mask,
                scale_input,
            ],
            outputs=2,
        )
    typed_like(outs[1], query, None, torch.float32)
    return typed_like(outs[0], query, out_sizes)
