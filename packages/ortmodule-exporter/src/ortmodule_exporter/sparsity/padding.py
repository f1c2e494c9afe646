"""Padding elimination: token-wise layers run on the real tokens only.

A right-padded batch of 128-token sequences whose lengths lie between 64 and 128 spends a
quarter of every projection, feed-forward layer and LayerNorm on padding. Those layers treat
each token on its own, so they give the real tokens the same rows whether the padding rows are
there or not. :func:`eliminate_padding` rewrites the exported forward graph so that they run on
a ``(real tokens, features)`` tensor:

* the rows kept are the tokens whose attention-mask value is not 0, every token a loss counts
  (a label that is not ``ignore_index``), every position a pick reads (below), and every token
  of a sequence without a single real token (keys that are all masked average over every row,
  so nothing there may change);
* a tensor of shape ``(batch, seq, ...)`` entering a token-wise node is gathered into kept
  rows (:data:`~ortmodule_exporter.sparsity.token_rows.TAKE_ROWS`); one leaving the token-wise
  region for anything else (the heads' ``Reshape`` before attention) is put back into
  ``(batch, seq, ...)`` with zero rows for the tokens left out
  (:data:`~ortmodule_exporter.sparsity.token_rows.PUT_ROWS`); each move is the other's gradient;
* a ``Shape`` of a region tensor becomes the padded shape (the mask's dims, then the rows');
* a ``SoftmaxCrossEntropyLoss`` reading ``reshape(logits, (-1, vocab))`` reads the kept rows of
  the logits and of its labels instead; only rows whose label is ignored are left out, so the
  loss is the same;
* ``x[:, i]`` at a constant position (a sequence classifier pooling its first token) keeps
  position ``i`` of every sequence, padding or not, and reads those rows.

Rows left out are zeros after the scatter. That is exact only where nothing reads them, and the
pass proves it before it changes anything, refusing (and saying why) otherwise:

* every scattered tensor reaches the graph's outputs only through layout nodes that keep track
  of the ``(batch, seq)`` axes (``Reshape`` keeping the leading dims, ``Transpose``), fused
  attention nodes (on their token axis) and the gather back into the region; where a tensor
  leaks elsewhere, the node writing it computes on the padded tokens instead, and so on back;
* every such attention node has an additive mask computed from one user input (the attention
  mask) alone, and that mask is below :data:`MASKED` at every key left out, on the batch that
  caused the export and on a random probe mask: those keys get a softmax weight of exactly 0;
* no graph output other than a loss comes from the region;
* the rewritten graph's outputs equal the original's on the batch (``np.allclose``).

The forward graph is run with ONNX Runtime for those checks (twice for the original, once for
the rewrite), at graph build only.

Labelled rows (:func:`keep_labelled_rows`, part of label sparsity) is the same rewrite with
other rows kept: the tokens whose label a ``SoftmaxCrossEntropyLoss`` counts. Attention reads
every token, so no row may be left out where anything but the region and the losses reads it:
the region shrinks to the token-wise nodes that only the losses read (a masked LM's head, the
last layer's feed-forward block and attention output projection), nothing is put back, and no
attention mask is needed. A batch without a single counted label keeps its first token, so no
tensor is empty. The engine's own label sparsity (``InsertGatherBeforeSceLoss``) gathers the
counted rows before the loss only: its gather does not pass the ``Reshape`` that merges batch
and sequence.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import aten_cross_entropy, cross_entropy_route
from ..onnx_graph import attribute, constant_values, producers_and_consumers
from .graph_eval import evaluate_graph
from .row_indices import RowBuilder, kept_indices, labelled_indices
from .token_region import (
    ATTENTION_OPS,
    MASKED,
    Loss,
    Refused,
    Region,
    check_masked,
    loss_cone,
    loss_grids,
    mask_source,
    position_picks,
    region_exits,
    region_leak,
    token_losses,
    token_region,
    token_tensor,
)
from .token_rows import PUT_ROWS, TAKE_ROWS

__all__ = [
    "LABELLED",
    "MASKED",
    "PaddingDecision",
    "eliminate_padding",
    "evaluate_graph",
    "keep_labelled_rows",
]


logger = logging.getLogger("ortmodule.padding")


PREFIX = "padding_elimination"


#: the name of the kept-token dim in the rewritten graph's shapes
TOKENS = "padding_elimination_tokens"


_LABEL_PREFIX = "labelled_rows"


#: the name of the labelled-token dim in a graph :func:`keep_labelled_rows` rewrote
LABELLED = "labelled_rows_tokens"


@dataclass
class PaddingDecision:
    """What :func:`eliminate_padding` did, for the log and for tests."""

    applied: bool
    reason: str
    mask_input: str | None = None
    #: share of the batch's tokens the token-wise layers still compute
    density: float | None = None
    token_wise_nodes: int = 0
    gathers: int = 0
    scatters: int = 0
    losses: list[str] = field(default_factory=list)


def eliminate_padding(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    user_inputs: set[str] | frozenset[str],
    threshold: float = 0.9,
) -> PaddingDecision:
    """Rewrite ``model`` (in place) so token-wise nodes skip padding; see the module docstring.

    ``feeds`` holds the batch that caused the export by graph input name (user inputs and
    parameters). ``user_inputs`` names the graph inputs that are the user's data. Applied when
    under ``threshold`` of the tokens are kept. On refusal ``model`` is unchanged."""
    return _guarded(model, feeds, user_inputs, threshold, labels_only=False)


def keep_labelled_rows(
    model: onnx.ModelProto, feeds: Mapping[str, Any], threshold: float = 0.9
) -> PaddingDecision:
    """Rewrite ``model`` (in place) so the token-wise nodes that only a loss reads run on the
    tokens whose label counts; see the module docstring. ``feeds`` holds the batch that caused
    the export by graph input name (user inputs and parameters). Applied when under
    ``threshold`` of the tokens are labelled. On refusal ``model`` is unchanged."""
    return _guarded(model, feeds, frozenset(), threshold, labels_only=True)


def _guarded(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    user_inputs: set[str] | frozenset[str],
    threshold: float,
    labels_only: bool,
) -> PaddingDecision:
    """:func:`_eliminate`, with ``model`` left as it was on any refusal or failure."""
    original = onnx.ModelProto()
    original.CopyFrom(model)
    try:
        return _eliminate(model, feeds, user_inputs, threshold, labels_only)
    except Refused as why:
        model.CopyFrom(original)
        return PaddingDecision(False, str(why))
    except Exception as err:  # noqa: BLE001 - an optional optimization never stops training
        model.CopyFrom(original)
        return PaddingDecision(False, f"{type(err).__name__}: {err}")


@dataclass
class _Plan:
    """What the analysis of one graph on one batch decided, which the rewrite follows."""

    labels_only: bool
    #: the attention mask input (padding elimination) and the masks the attention nodes read
    source: str
    masks: list[str]
    #: the (batch, seq) of the tokens
    grid: tuple[int, int]
    mask_value: np.ndarray
    #: every value of the forward on the batch (the losses' cone for labelled rows)
    values: dict[str, Any]
    types: dict[str, onnx.TensorProto.DataType]
    region: Region
    losses: list[Loss]
    absorbed: set[str]
    #: id(node) -> the sequence position it picks (``x[:, i]``)
    picks: dict[int, int]
    #: ids of the Shape nodes that read a region tensor: given the padded shape back
    shapes: set[int]
    labelled: np.ndarray
    density: float
    #: the graph's nodes: the id()s above are of these objects, which must stay alive until
    #: the rewrite is done (protobuf hands out a new wrapper for a node nobody holds, and a
    #: freed wrapper's id can come back as another node's)
    nodes: list[onnx.NodeProto]


def _eliminate(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    user_inputs: set[str] | frozenset[str],
    threshold: float,
    labels_only: bool = False,
) -> PaddingDecision:
    """Padding elimination, or with ``labels_only`` the rows of the labelled tokens: no
    attention mask is needed, and no region tensor may reach anything but the region and the
    losses (attention reads every token). Analyse, rewrite, then check that the rewritten graph
    computes the same outputs on this batch."""
    plan = _analyse(model, feeds, user_inputs, threshold, labels_only)
    gathers, scatters = _rewrite(model.graph, plan)
    names = [o.name for o in model.graph.output]
    after = evaluate_graph(model, feeds, outputs=names, types=plan.types)
    for name in names:
        if not np.allclose(after[name], plan.values[name], rtol=1e-4, atol=1e-5, equal_nan=True):
            raise Refused(
                f"the rewritten graph's output {name} differs from the original's on this batch"
            )
    return PaddingDecision(
        True,
        (
            "the token-wise nodes only a loss reads run on the labelled tokens"
            if labels_only
            else "token-wise nodes run on the kept tokens only"
        ),
        mask_input=plan.source,
        density=plan.density,
        token_wise_nodes=len(plan.region.nodes),
        gathers=gathers,
        scatters=scatters,
        losses=[n.name for n, _, _ in plan.losses],
    )


def _analyse(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    user_inputs: set[str] | frozenset[str],
    threshold: float,
    labels_only: bool,
) -> _Plan:
    """The region, the losses and the kept tokens on this batch, or :class:`Refused`."""
    graph = model.graph
    calls = sorted({attribute(n, "func_name", "?") for n in graph.node if n.op_type == "PythonOp"})
    if calls:
        # the checks run the forward graph; the user's Python code must not run outside a step
        raise Refused(f"the graph calls Python code (PythonOp {', '.join(calls)})")
    producer, consumers = producers_and_consumers(graph)
    masks, source = _attention_masks(graph, producer, user_inputs, labels_only)
    # labelled rows reads the tensors near the losses only: holding every activation of the
    # forward (the padding elimination's view) cost the benchmark masked LM 130 MiB of peak
    # memory at graph build
    values = evaluate_graph(
        model,
        feeds,
        outputs=loss_cone(graph, producer, consumers, user_inputs) if labels_only else None,
    )
    types = {
        name: onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        for name, value in values.items()
        if isinstance(value, np.ndarray)
    }
    grid, mask_value = _grid(graph, producer, values, source, labels_only)
    region, losses, absorbed, picks, shapes = _pruned_region(
        graph, values, grid, producer, consumers, labels_only
    )
    dropped = mask_value == 0
    labelled = np.zeros(grid, dtype=bool)
    for node, _, ignore in losses:
        labelled |= (values[node.input[1]] != ignore).reshape(grid)
    for position in set(picks.values()):
        if position < grid[1]:
            labelled[:, position] = True
    if labels_only:
        dropped = ~labelled
    else:
        empty = ~(~dropped).any(axis=1, keepdims=True)
        dropped = dropped & ~labelled & ~empty
    density = 1.0 - float(dropped.mean())
    if density >= threshold:
        raise Refused(f"{density:.1%} of the tokens are kept, not under {threshold:.0%}")
    if not labels_only:
        check_masked(values, masks, dropped)
        rng = np.random.default_rng(0)
        probe_mask = (rng.random(grid) < 0.7).astype(mask_value.dtype)
        probe_mask[:, 0] = 1
        probe_values = evaluate_graph(
            model, {**feeds, source: probe_mask}, outputs=masks, types=types
        )
        check_masked(probe_values, masks, probe_mask == 0)
    return _Plan(
        labels_only,
        source,
        masks,
        grid,
        mask_value,
        values,
        types,
        region,
        losses,
        absorbed,
        picks,
        shapes,
        labelled,
        density,
        list(graph.node),
    )


def _attention_masks(
    graph: onnx.GraphProto,
    producer: Mapping[str, onnx.NodeProto],
    user_inputs: set[str] | frozenset[str],
    labels_only: bool,
) -> tuple[list[str], str]:
    """The masks the fused attention nodes read and the input they come from (padding
    elimination), or nothing once a loss reads reshaped logits (labelled rows)."""
    if labels_only:
        if not loss_grids(graph, producer):
            raise Refused("no cross-entropy loss reads reshape(logits, (-1, classes))")
        return [], ""
    attention = [
        n
        for n in graph.node
        if n.domain == ATEN_DOMAIN and attribute(n, "operator", "") in ATTENTION_OPS
    ]
    if not attention:
        raise Refused("no fused attention node (ORTMODULE_FUSED_ATTENTION) reads a padding mask")
    masks = [n.input[5] if len(n.input) > 5 else "" for n in attention]
    if "" in masks:
        raise Refused("an attention node has no mask, so padding tokens are attended to")
    return masks, mask_source(graph, masks, user_inputs)


def _grid(
    graph: onnx.GraphProto,
    producer: Mapping[str, onnx.NodeProto],
    values: Mapping[str, Any],
    source: str,
    labels_only: bool,
) -> tuple[tuple[int, int], np.ndarray]:
    """The (batch, seq) of the tokens, and the mask of the kept ones (all ones for labels)."""
    if labels_only:
        grid_of = {tuple(values[name].shape[:2]) for name in loss_grids(graph, producer)}
        if len(grid_of) != 1:
            raise Refused(f"the losses' logits have (batch, seq) dims {sorted(grid_of)}")
        ((rows_grid, cols_grid),) = grid_of
        grid = (int(rows_grid), int(cols_grid))
        return grid, np.ones(grid, dtype=np.int64)
    mask_value = values[source]
    if mask_value.ndim != 2:
        raise Refused(f"the attention mask input {source} has rank {mask_value.ndim}, not 2")
    return (int(mask_value.shape[0]), int(mask_value.shape[1])), mask_value


def _pruned_region(
    graph: onnx.GraphProto,
    values: Mapping[str, Any],
    grid: tuple[int, int],
    producer: Mapping[str, onnx.NodeProto],
    consumers: Mapping[str, list[onnx.NodeProto]],
    labels_only: bool,
) -> tuple[Region, list[Loss], set[str], dict[int, int], set[int]]:
    """The token-wise region, pruned until none of its tensors leaks where the padded tokens
    are read: the node writing a leaking tensor computes on the padded tokens, as exported."""
    # every initializer as an array: once, not in each round of the pruning below
    constants = constant_values(graph)
    outputs = {o.name for o in graph.output}
    region = token_region(graph, values, constants, grid)
    first_leak = ""
    while True:
        losses, absorbed = token_losses(graph, region, values, grid, producer, consumers)
        picks = {} if labels_only else position_picks(graph, region, values, constants)
        scatter, shapes = region_exits(region, absorbed, picks, consumers, outputs)
        leak = region_leak(scatter, region, consumers, values, grid, outputs, not labels_only)
        if leak is None and labels_only and scatter:
            # the rows of the unlabelled tokens exist nowhere to put back
            name = sorted(scatter)[0]
            leak = name, f"{name} is read outside the loss's token-wise nodes"
        if leak is None:
            break
        origin, why = leak
        first_leak = first_leak or why
        region.nodes = [n for n in region.nodes if origin not in n.output]
        region.flat = {o for n in region.nodes for o in n.output if o}
        if not region.nodes:
            skipped = "the unlabelled tokens" if labels_only else "the padding"
            raise Refused(f"no token-wise node can skip {skipped}: {first_leak}")
    if labels_only and not losses:
        raise Refused(f"no token-wise node feeds only a loss: {first_leak}")
    return region, losses, absorbed, picks, shapes


def _rewrite(graph: onnx.GraphProto, plan: _Plan) -> tuple[int, int]:
    """Token-wise nodes on the kept rows: their token inputs gathered, their outputs read
    elsewhere scattered back; the losses on the kept rows. Returns (gathers, scatters)."""
    labels_only, values, region, grid = plan.labels_only, plan.values, plan.region, plan.grid
    losses, picks, shapes, absorbed = plan.losses, plan.picks, plan.shapes, plan.absorbed
    region_nodes = {id(n) for n in region.nodes}
    loss_nodes = {id(node) for node, _, _ in losses}
    b = RowBuilder(_LABEL_PREFIX if labels_only else PREFIX)
    label_sets = [(n.input[1], ig) for n, _, ig in losses]
    if labels_only:
        rows, inverse = labelled_indices(b, label_sets)
        # the padded (batch, seq) from a tensor entering the region
        entering = sorted(
            name
            for n in region.nodes
            for name in n.input
            if name and name not in region.flat and token_tensor(values, name, grid)
        )
        mask_shape = b.one(
            "Slice",
            [
                b.one("Shape", [entering[0]], "entering_shape"),
                b.const("start", np.array([0], np.int64)),
                b.const("two", np.array([2], np.int64)),
            ],
            "grid",
        )
        inverse = b.one("Reshape", [inverse, mask_shape], "inverse")
    else:
        rows, inverse, mask_shape = kept_indices(
            b, plan.source, plan.mask_value.dtype, label_sets, set(picks.values())
        )
    gathered: dict[str, str] = {}
    scattered: dict[str, str] = {}
    infos: list[onnx.ValueInfoProto] = []
    declared = {vi.name: vi for vi in graph.value_info}
    grid_dims: list[str | int] = [
        d.dim_param or d.dim_value
        for vi in graph.input
        if vi.name == plan.source
        for d in vi.type.tensor_type.shape.dim
    ] or [f"{_LABEL_PREFIX}_batch", f"{_LABEL_PREFIX}_seq"]

    def dims_of(name: str) -> list[str | int]:
        """``name``'s padded dims: as declared, else (mask dims, sizes on this batch)."""
        vi = declared.get(name)
        if vi is not None and len(vi.type.tensor_type.shape.dim) == values[name].ndim:
            return [
                d.dim_param or d.dim_value or f"{name}_dim{k}"
                for k, d in enumerate(vi.type.tensor_type.shape.dim)
            ]
        return [*grid_dims[:2], *values[name].shape[2:]]

    def shape_from(name: str, axis: int) -> str:
        # Shape + Slice, not Shape(start=): symbolic shape inference ignores ``start``
        ends = b.const("int_max", np.array([np.iinfo(np.int64).max], np.int64))
        starts = b.const("start", np.array([axis], np.int64))
        return b.one("Slice", [b.one("Shape", [name], "shape"), starts, ends], "shape_tail")

    def moved(operator: str, name: str, what: str, dims: list[str | int]) -> str:
        out = b.one("ATen", [name, rows, inverse], what, domain=ATEN_DOMAIN, operator=operator)
        elem = onnx.helper.np_dtype_to_tensor_dtype(values[name].dtype)
        infos.append(onnx.helper.make_tensor_value_info(out, elem, dims))
        return out

    def gather(name: str) -> str:
        if name not in gathered:
            kept = LABELLED if labels_only else TOKENS
            gathered[name] = moved(TAKE_ROWS, name, "take_rows", [kept, *dims_of(name)[2:]])
        return gathered[name]

    def scatter_back(name: str) -> str:
        if name not in scattered:
            scattered[name] = moved(PUT_ROWS, name, "put_rows", dims_of(name))
        return scattered[name]

    new_nodes: list[onnx.NodeProto] = list(b.nodes)
    b.nodes.clear()
    for node in graph.node:
        if id(node) in region_nodes:
            for k, name in enumerate(node.input):
                if name and name not in region.flat and token_tensor(values, name, grid):
                    node.input[k] = gather(name)
        elif id(node) in loss_nodes:
            ((_, tokens, _),) = [(n, t, i) for n, t, i in losses if n is node]
            node.input[0] = tokens
            node.input[1] = b.one("Gather", [node.input[1], rows], "gather_labels", axis=0)
        elif node.name in absorbed:
            continue
        elif id(node) in picks:
            # x[:, i] -> the rows of x[:, i]: the kept row of each sequence's position i
            at = b.const("picked", np.array(picks[id(node)], np.int64))
            node.input[1] = b.one("Gather", [inverse, at], "picked_rows", axis=1)
            for a in node.attribute:
                if a.name == "axis":
                    a.i = 0
        else:
            for k, name in enumerate(node.input):
                if name in region.flat and id(node) not in shapes:
                    node.input[k] = scatter_back(name)
        new_nodes.extend(b.nodes)
        b.nodes.clear()
        if id(node) in shapes:
            # the padded shape: (batch, seq) from the mask, the rest from the kept rows
            name = node.input[0]
            rest = shape_from(name, 1)
            new_nodes.extend(b.nodes)
            b.nodes.clear()
            new_nodes.append(
                onnx.helper.make_node(
                    "Concat", [mask_shape, rest], list(node.output), name=node.name, axis=0
                )
            )
            continue
        new_nodes.append(node)
    if labels_only:
        read = {name for n in new_nodes for name in n.input} | {o.name for o in graph.output}
        new_nodes = [
            _routed_loss(node, values, int(plan.labelled.sum()), b, infos, read)
            if id(node) in loss_nodes
            else node
            for node in new_nodes
        ]
    del graph.node[:]
    graph.node.extend(_topological(new_nodes))
    graph.initializer.extend(b.initializers)
    replaced = {vi.name for vi in infos}
    kept_infos = [vi for vi in graph.value_info if vi.name not in replaced]
    del graph.value_info[:]
    graph.value_info.extend(kept_infos)
    graph.value_info.extend(infos)
    for vi in graph.value_info:  # (batch, seq, ...) -> (kept tokens, ...)
        if vi.name in region.flat and vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            if len(dims) >= 2:
                del dims[0]
                dims[0].Clear()
                dims[0].dim_param = LABELLED if labels_only else TOKENS
    return len(gathered), len(scattered)


def _routed_loss(
    loss: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    rows: int,
    b: RowBuilder,
    infos: list[onnx.ValueInfoProto],
    read: set[str],
) -> onnx.NodeProto:
    """``loss`` on PyTorch's kernel where kernel choice times it faster at the labelled rows'
    size (the exported graph left the engine's node for the engine's label sparsity); ``read``:
    the names the graph reads (the ATen node has no ``log_prob`` output)."""
    logits = values[loss.input[0]]  # as computed before the rewrite: (batch, seq, classes)
    classes = int(logits.shape[-1])
    if (
        len(loss.input) != 2  # class weights: the engine's node
        or (len(loss.output) > 1 and loss.output[1] in read)
        or logits.dtype != np.float32
        or cross_entropy_route(rows, classes) != "torch"
    ):
        return loss
    node, params = aten_cross_entropy(loss)
    b.initializers.append(params)
    elem = onnx.TensorProto.FLOAT
    infos.append(onnx.helper.make_tensor_value_info(node.output[0], elem, []))
    infos.append(onnx.helper.make_tensor_value_info(node.output[1], elem, [LABELLED]))
    infos.append(onnx.helper.make_tensor_value_info(node.output[2], elem, []))
    return node


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` reordered so each comes after the writers of its inputs, otherwise in the
    order given (the new index nodes were put first)."""
    writer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waits = [{writer[i] for i in n.input if i in writer} for n in nodes]
    readers: dict[int, list[int]] = {}
    for k, deps in enumerate(waits):
        for d in deps:
            readers.setdefault(d, []).append(k)
    ready = [k for k, deps in enumerate(waits) if not deps]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for r in readers.get(k, []):
            waits[r].discard(k)
            if not waits[r]:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise Refused("the rewritten graph has a cycle")
    return [nodes[k] for k in order]
