"""Embedding lookups (``padding_idx`` and ``scale_grad_by_freq`` included), covered from the
exporter's own ``embedding`` symbolic, which calls :func:`embedding_route` through the hook
``symbolics.embedding.LOOKUP_ROUTE`` this module fills: the engine's ``Gather`` + ``GatherGrad``
or PyTorch's ``embedding`` and ``embedding_backward`` as an ATen node.

>>> from ortmodule_exporter.aten.kernel_choice import measure_embedding
>>> engine_us, torch_us = measure_embedding(100, 16, 64)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ...symbolics import embedding as embedding_symbolic
from ...torchscript_onnx import symbolic_helper as sh
from .. import output_pool
from ..executor import AtenFunction, register_aten_function
from ..routes import embedding_node
from .choice import _decide, _size_class
from .fx_nodes import (
    AtenChoice,
    fx_arg,
    fx_float32,
    fx_needs_grad,
    fx_sizes,
    register_fx_kernel_choice,
)
from .helpers import _all_tensors, _dtype, _ints_const
from .measuring import _engine_us, _randn, _seeded, _torch_us
from .modes import current_mode
from .traced import _traced

logger = logging.getLogger("ortmodule.exporter")

#: a table's lookup gradient added to its other gradients (``passes/embedding_grad_sums.py``)
EMBEDDING_GRAD_ADD = "_ortmodule_embedding_grad_add"


def embedding_grad_add_overload(in_place: bool, padding_idx: int = -1) -> str:
    """The overload name of an :data:`EMBEDDING_GRAD_ADD` node: ``"in_place|-1"``."""
    return f"{'in_place' if in_place else ''}|{int(padding_idx)}"


def _embedding_grad_add(
    overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """A lookup's gradient (the engine's ``GatherGrad`` on axis 0, or PyTorch's
    ``embedding_backward`` without frequency scaling) plus the table's other gradients, in one
    pass over the table. Inputs: the table's shape or its row count, the indices, ``dY`` (the
    lookups' gradient), then the others. Overload ``"in_place|P"``: the first other is a buffer
    no one else reads (a product's output), which the rows are added into; ``"|P"``: the sum
    goes to a new table. Rows looked up at ``P`` (a padding index, or -1) add nothing, as
    ``embedding_backward`` gives that row no gradient."""
    size, indices, dy, *others = inputs
    assert size is not None and indices is not None and dy is not None and others
    mode, padding = overload.split("|")
    dims = [int(size.reshape(-1)[0]), *dy.shape[indices.dim() :]]
    first = others[0]
    assert first is not None
    if mode == "in_place" and list(first.shape) == dims and first.is_contiguous():
        out = first
    else:
        out = output_pool.empty_unpooled(dims, dy.dtype, dy.device)  # the user's .grad
        out.copy_(first)  # broadcasts a summand of another shape, as Sum does
    for other in others[1:]:
        assert other is not None
        out.add_(other)
    flat, rows = indices.reshape(-1).long(), dy.reshape(-1, *dims[1:])
    if bool((flat < 0).any()):  # Gather's negative indices count from the end
        flat = torch.where(flat < 0, flat + dims[0], flat)
    if int(padding) >= 0:
        kept = flat != int(padding)
        flat, rows = flat[kept], rows[kept]
    out.index_add_(0, flat, rows.to(out.dtype))
    return [out]


register_aten_function(EMBEDDING_GRAD_ADD, AtenFunction(_embedding_grad_add, _all_tensors))


def measure_embedding(rows: int, dim: int, lookups: int) -> tuple[float, float]:
    """Microseconds of an embedding lookup of ``lookups`` indices into a ``rows`` x ``dim``
    table, forward + backward (the table's gradient): (engine, torch). Engine: ``Gather`` +
    ``GatherGrad``; PyTorch: ``embedding`` and ``embedding_backward``, two ATen nodes."""
    from onnx import TensorProto, helper

    _seeded()
    # the table's values change neither route's time, only that its pages are real: a
    # constant fill, not random numbers (0.19 s for GPT-2's 50257 x 768 table)
    w, dy = torch.full((rows, dim), 0.5), _randn(lookups, dim)
    idx = torch.randint(0, rows, (lookups,), generator=_randn.gen)  # type: ignore[attr-defined]
    nodes = [
        helper.make_node("Gather", ["w", "idx"], ["y"]),
        helper.make_node("Shape", ["w"], ["shape"]),
        helper.make_node("GatherGrad", ["shape", "idx", "dy"], ["dw"], domain="com.microsoft"),
    ]
    feeds = {"w": w, "idx": idx, "dy": dy}
    engine_us = _engine_us(
        "embedding",
        nodes,
        feeds,
        ["y", "dw"],
        {"idx": TensorProto.INT64},
        {"y": (lookups, dim), "dw": (rows, dim)},
    )

    def torch_route() -> None:
        torch.ops.aten.embedding(w, idx)
        torch.ops.aten.embedding_backward(dy, idx, rows, -1, False, False)

    return engine_us, _torch_us(torch_route, engine_us=engine_us)


#: operators that read a tensor's metadata, not its values: no gradient flows through them
_METADATA_READS = frozenset(
    {"aten::size", "aten::dim", "aten::numel", "prim::shape", "prim::device", "prim::dtype"}
    | {"aten.sym_size.int", "aten.sym_numel.default", "aten.dim.default"}
)


def _read_elsewhere(op: str, readers: Iterable[str]) -> bool:
    """Whether a table is read by an operator besides its lookup (``readers``: the kinds or
    targets of the other nodes reading it), a tied LM head's product say, asked where the
    kernel choice measures (``auto``; ``torch`` still forces PyTorch's lookup). Then its gradient is
    the sum of the lookup's and the others', which the built-graph pass
    ``passes/embedding_grad_sums.py`` makes one ATen node on the CPU whichever route the
    lookup takes, and the route decides only the forward lookup, a copy of the looked-up rows
    either way: the engine's ``Gather``, untimed (timing GPT-2's 50257-row table's gradient
    took 0.5 s of its cold start)."""
    if current_mode() != "auto":
        return False
    values = [r for r in readers if r not in _METADATA_READS]
    if not values:
        return False
    logger.info(
        "kernel choice: %s is also read by %s: the engine's lookup, not timed (its gradient "
        "is summed with theirs in one pass either way)",
        op,
        ", ".join(sorted(set(values))),
    )
    return True


def embedding_route(
    g: Any, weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False
) -> Any:
    """An ATen ``embedding`` node (PyTorch's lookup and ``embedding_backward``, with
    ``padding_idx`` and ``scale_grad_by_freq`` as eager has them) where PyTorch's kernels
    measured faster, else None (the exporter's own form). Called by the exporter's
    ``embedding`` symbolic.

    Timed on the plain lookup (``Gather`` + ``GatherGrad`` against PyTorch's pair): the
    engine's form with a padding row or frequency scaling adds nodes to that (an ``Equal``,
    a ``Where`` and a second ``Gather``; a ``ScatterElements`` count), PyTorch's pair stays
    one kernel each, so where PyTorch wins the plain lookup it wins these too."""
    if current_mode() == "engine":
        return None
    weight_sizes = sh._get_tensor_sizes(weight)
    traced = _traced(g)
    if (
        _dtype(weight) != "Float"
        or weight_sizes is None
        or len(weight_sizes) != 2
        or any(s is None for s in weight_sizes)
        or traced is None
        # F.embedding(indices, weight): the table's gradient must be wanted
        or len(traced.needs_grad) != 2
        or not traced.needs_grad[1]
        or len(traced.sizes) < 2
        or traced.sizes[1] is None
    ):
        return None
    rows, dim = (int(s) for s in weight_sizes)
    op = f"embedding({rows}x{dim})"
    node = getattr(g, "original_node", None)
    if node is not None and _read_elsewhere(
        op, (u.user.kind() for u in node.inputsAt(0).uses() if u.user != node)
    ):
        return None
    lookups = _size_class(math.prod(traced.sizes[1]))
    route = _decide(op, "Float", lookups, lambda: measure_embedding(rows, dim, lookups))
    if route != "torch":
        return None
    out = embedding_node(
        g, weight, indices, padding_idx, scale_grad_by_freq, index_rank=len(traced.sizes[1])
    )
    # The engine knows no shape for an ATen node's output, whatever the graph declares, and
    # its broadcasting gradients need one (a position embedding added to a batch of token
    # embeddings: "GetShape(input_grad ...) was false"); a Reshape to the indices' shape plus
    # the embedding dim, which it infers the rank of, gives it one.
    shape = g.op("Concat", g.op("Shape", indices), _ints_const(g, [dim]), axis_i=0)
    reshaped = g.op("Reshape", out, shape)
    reshaped.setType(out.type())
    return reshaped


embedding_symbolic.LOOKUP_ROUTE[0] = embedding_route


def _embedding_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`embedding_route`: the same ATen ``embedding`` node, and
    the same Reshape to the indices' shape after it."""
    weight, indices = fx_arg(node, 0, "weight"), fx_arg(node, 1, "indices")
    padding_idx = fx_arg(node, 2, "padding_idx", -1)
    by_freq = fx_arg(node, 3, "scale_grad_by_freq", False)
    weight_sizes, index_sizes = fx_sizes(weight, symbolic=False), fx_sizes(indices)
    if (
        not fx_float32(weight)
        or weight_sizes is None
        or len(weight_sizes) != 2
        # the table's gradient must be wanted
        or not fx_needs_grad(weight)
        or index_sizes is None
        or not isinstance(padding_idx, int)
        or not isinstance(by_freq, bool)
        or fx_arg(node, 4, "sparse", False) is not False
    ):
        return None
    rows, dim = weight_sizes
    op = f"embedding({rows}x{dim})"
    if _read_elsewhere(op, (str(u.target) for u in weight.users if u is not node)):
        return None
    lookups = _size_class(math.prod(index_sizes))
    route = _decide(op, "Float", lookups, lambda: measure_embedding(rows, dim, lookups))
    if route != "torch":
        return None
    constants = (np.array(padding_idx, np.int64), np.array(by_freq), np.array(False))
    return AtenChoice("embedding", "", (weight, indices, *constants), reshape_like=(indices, dim))


register_fx_kernel_choice([torch.ops.aten.embedding.default], _embedding_fx)
