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
import torch

from ..aten import executor as aten_executor
from ..aten.attention_layout import FLASH, FLASH_BSHD
from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import GELU, LAYER_NORM, aten_cross_entropy, cross_entropy_route
from ..engine_binding import import_onnxruntime
from ..named_dims import infer_symbolic_shapes
from ..onnx_graph import attribute, constant_values, producers_and_consumers
from .density import _cone
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

#: an additive attention mask at or below this gives the key a softmax weight of exactly 0
MASKED = -1e30
_PREFIX = "padding_elimination"
#: the name of the kept-token dim in the rewritten graph's shapes
TOKENS = "padding_elimination_tokens"
_LABEL_PREFIX = "labelled_rows"
#: the name of the labelled-token dim in a graph :func:`keep_labelled_rows` rewrote
LABELLED = "labelled_rows_tokens"
_ATTENTION = frozenset({FLASH, FLASH_BSHD})
#: ONNX operators that act on each element alone (any extra inputs must be scalars or vectors)
_ELEMENTWISE = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Relu", "Tanh", "Sigmoid", "Erf", "Neg", "Sqrt",
        "Exp", "Log", "Abs", "Cast", "Identity", "Softplus", "LeakyRelu", "Elu", "Selu",
        "HardSigmoid", "Softsign", "Reciprocal", "Gelu", "FastGelu", "QuickGelu", "BiasGelu",
    }
)  # fmt: skip
_LAYOUT = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Cast"})
_SHAPE_ONLY = frozenset({"Shape", "Size"})
_DROPOUT = frozenset({"Dropout", "BitmaskDropout"})
_NO_TRAINING = f"{_PREFIX}/probe_training_mode_false"


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


def evaluate_graph(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    outputs: list[str] | None = None,
    types: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Every node output of ``model``'s graph (or ``outputs``) on ``feeds``, by ONNX Runtime.

    Graph inputs missing from ``feeds`` get zeros of their declared shape. PyTorch-run (ATen)
    nodes run through the exporter's executor; their outputs' element types come from ``types``
    (value name -> ONNX element type) or, without it, from symbolic shape inference."""
    ort = import_onnxruntime()
    aten_executor.install()
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    graph = probe.graph
    names = outputs or [o for n in graph.node for o in n.output if o]
    # element types (no shapes, which the rewrite changes) where ONNX Runtime cannot infer
    # them: an ATen node's outputs
    known = {vi.name: vi.type.tensor_type.elem_type for vi in (*graph.value_info, *graph.output)}
    if types is None and any(
        n.domain == ATEN_DOMAIN and any(o not in known for o in n.output) for n in graph.node
    ):
        inferred = infer_symbolic_shapes(model).graph
        types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.value_info}
    known = {**(types or {}), **known}
    # dropout off: two runs must give the same outputs to be compared
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(False), _NO_TRAINING))
    for node in graph.node:
        if node.op_type in _DROPOUT:
            inputs = [*node.input[:2], *[""] * (2 - len(node.input[:2])), _NO_TRAINING]
            del node.input[:]
            node.input.extend(inputs)
    del graph.output[:]
    del graph.value_info[:]
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    graph.value_info.extend(
        onnx.helper.make_tensor_value_info(o, known[o], None)
        for n in graph.node
        if n.domain == ATEN_DOMAIN
        for o in n.output
        if o and known.get(o)
    )
    values: dict[str, np.ndarray] = {}
    for vi in graph.input:  # the inputs as fed are part of the answer too
        value = feeds.get(vi.name)
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if value is None:
            t = vi.type.tensor_type
            value = np.zeros(
                [d.dim_value for d in t.shape.dim],
                dtype=onnx.helper.tensor_dtype_to_np_dtype(t.elem_type),
            )
        values[vi.name] = np.asarray(value)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    # PyTorch-run nodes may draw from the user's generators; the probe leaves them as they were
    with torch.random.fork_rng(devices=[]):
        results = session.run(names, values)
    return {**values, **dict(zip(names, results, strict=True))}


class _Refused(Exception):
    """Why the pass leaves the graph as it is."""


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
    except _Refused as why:
        model.CopyFrom(original)
        return PaddingDecision(False, str(why))
    except Exception as err:  # noqa: BLE001 - an optional optimization never stops training
        model.CopyFrom(original)
        return PaddingDecision(False, f"{type(err).__name__}: {err}")


def _mask_source(
    graph: onnx.GraphProto, masks: list[str], user_inputs: set[str] | frozenset[str]
) -> str:
    """The one user input every attention mask is computed from (shapes aside)."""
    sources: set[str] = set()
    for mask in masks:
        _, found = _cone(graph, mask, stop=_SHAPE_ONLY)  # values, not shapes
        if not found or not found <= user_inputs:
            others = sorted(found - set(user_inputs))
            raise _Refused(
                f"the attention mask {mask} is not computed from the user's inputs alone "
                f"(it reads {', '.join(others) or 'no input'})"
            )
        sources |= found
    if len(sources) != 1:
        raise _Refused(f"the attention masks come from {sorted(sources)}, not from one input")
    return next(iter(sources))


def _check_masked(values: Mapping[str, np.ndarray], masks: list[str], dropped: np.ndarray) -> None:
    """Every key in ``dropped`` (batch, seq) is masked to a softmax weight of 0 in each mask."""
    batch, seq = dropped.shape
    for mask in masks:
        value = values[mask]
        if value.ndim != 4 or value.shape[0] not in (1, batch) or value.shape[-1] != seq:
            raise _Refused(
                f"the attention mask {mask} has shape {value.shape}, not (batch, ., ., seq)"
            )
        full = np.broadcast_to(value, (batch, *value.shape[1:]))
        keys = np.moveaxis(full, -1, 1)[dropped]  # (dropped keys, heads, queries)
        if keys.size and not (keys <= MASKED).all():
            raise _Refused(f"the attention mask {mask} does not mask every padding token")


@dataclass
class _Region:
    """The token-wise nodes and the tensors they compute as (kept tokens, ...) rows."""

    nodes: list[onnx.NodeProto]
    flat: set[str]


def _token_tensor(values: Mapping[str, np.ndarray], name: str, grid: tuple[int, int]) -> bool:
    value = values.get(name)
    return value is not None and value.ndim >= 3 and tuple(value.shape[:2]) == grid


def _small(
    values: Mapping[str, np.ndarray], constants: Mapping[str, np.ndarray], name: str, rank: int
) -> bool:
    value = values.get(name)
    if value is None:
        value = constants.get(name)
    return name == "" or (value is not None and value.ndim <= rank)


def _token_wise(
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    constants: Mapping[str, np.ndarray],
    grid: tuple[int, int],
) -> bool:
    """Whether ``node`` computes each token's row from that token's rows alone."""
    tokens = [i for i in node.input if _token_tensor(values, i, grid)]
    if not tokens or not _token_tensor(values, node.output[0], grid):
        return False
    others = [(k, i) for k, i in enumerate(node.input) if i not in tokens]
    if node.domain in ("", "ai.onnx"):
        if node.op_type in _ELEMENTWISE:
            return all(_small(values, constants, i, 1) for _, i in others)
        if node.op_type == "MatMul":
            # a 2-d right operand; two token tensors would be a product over the tokens
            return tokens == [node.input[0]] and _small(values, constants, node.input[1], 2)
        if node.op_type == "Dropout":
            return node.input[0] in tokens and all(
                _small(values, constants, i, 0) for _, i in others
            )
        if node.op_type in ("Slice", "Split"):
            # along feature axes only: constant axes, none of them batch or seq
            rank = values[node.input[0]].ndim
            if node.op_type == "Slice":
                axes = constants.get(node.input[3]) if len(node.input) > 3 else None
            else:
                axes = np.array([attribute(node, "axis", 0)])
            return (
                node.input[0] in tokens
                and len(tokens) == 1
                and axes is not None
                and all(int(a) % rank >= 2 for a in axes.reshape(-1))
                and all(_token_tensor(values, o, grid) for o in node.output if o)
                and all(_small(values, constants, i, 1) for _, i in others)
            )
        if node.op_type in ("LayerNormalization", "Softmax", "LogSoftmax"):
            axis = attribute(node, "axis", -1)
            rank = values[node.input[0]].ndim
            return (
                axis in (-1, rank - 1)
                and node.input[0] in tokens
                and all(_small(values, constants, i, 1) for _, i in others)
            )
        return False
    if node.domain == "com.microsoft" and node.op_type in _ELEMENTWISE:
        return all(_small(values, constants, i, 1) for _, i in others)
    if node.domain == ATEN_DOMAIN:
        operator = attribute(node, "operator", "")
        if operator in ("gelu", GELU):
            return (
                len(tokens) == 1
                and node.input[0] in tokens
                and all(_small(values, constants, i, 0) for _, i in others)
            )
        if operator == LAYER_NORM:
            shape = constants.get(node.input[3]) if len(node.input) > 3 else None
            return (
                node.input[0] in tokens
                and len(tokens) == 1
                and shape is not None
                and shape.size == 1
                and all(_small(values, constants, i, 1) for _, i in others)
            )
    return False


def _region(
    graph: onnx.GraphProto,
    values: Mapping[str, np.ndarray],
    constants: Mapping[str, np.ndarray],
    grid: tuple[int, int],
) -> _Region:
    nodes = [n for n in graph.node if _token_wise(n, values, constants, grid)]
    flat = {o for n in nodes for o in n.output if o}
    return _Region(nodes, flat)


class _Builder:
    """New nodes, each named under :data:`_PREFIX`."""

    def __init__(self, prefix: str = _PREFIX) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}/{what}_{self.count}"

    def const(self, what: str, value: np.ndarray) -> str:
        name = self.name(what)
        self.initializers.append(onnx.numpy_helper.from_array(value, name))
        return name

    def op(
        self, op_type: str, inputs: list[str], what: str, outputs: int = 1, **attrs: Any
    ) -> list[str]:
        name = self.name(what)
        outs = [f"{name}/out{i}" for i in range(outputs)]
        self.nodes.append(onnx.helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], what: str, **attrs: Any) -> str:
        return self.op(op_type, inputs, what, **attrs)[0]


def _indices(
    b: _Builder,
    mask: str,
    mask_dtype: np.dtype,
    labels: list[tuple[str, int]],
    positions: set[int],
) -> tuple[str, str, str]:
    """Nodes computing the kept rows: (row indices [kept], inverse index [batch, seq], mask
    shape). ``positions``: token positions kept in every sequence (those a pick reads)."""
    zero = b.const("zero", np.zeros((), dtype=mask_dtype))
    shape = b.one("Shape", [mask], "mask_shape")
    real2d = b.one("Not", [b.one("Equal", [mask, zero], "is_pad")], "is_real")
    per_seq = b.one(
        "ReduceSum",
        [
            b.one("Cast", [real2d], "real_int", to=onnx.TensorProto.INT64),
            b.const("axis1", np.array([1], np.int64)),
        ],
        "real_per_seq",
        keepdims=1,
    )
    empty = b.one(
        "Expand",
        [b.one("Equal", [per_seq, b.const("zero_i64", np.array(0, np.int64))], "empty_seq"), shape],
        "empty_rows",
    )
    keep2d = b.one("Or", [real2d, empty], "keep_real")
    if positions:
        seq = b.one("Gather", [shape, b.const("one_i64", np.array(1, np.int64))], "seq_len")
        every = b.one(
            "Range",
            [
                b.const("zero_pos", np.array(0, np.int64)),
                seq,
                b.const("step", np.array(1, np.int64)),
            ],
            "positions",
        )
        for picked in sorted(positions):
            at = b.const("picked", np.array(picked, np.int64))
            keep2d = b.one("Or", [keep2d, b.one("Equal", [every, at], "is_picked")], "keep_picked")
    flat_shape = b.const("minus_one", np.array([-1], np.int64))
    keep = _or_labelled(b, b.one("Reshape", [keep2d, flat_shape], "keep_flat"), labels)
    rows, inverse_flat = _kept_rows(b, keep)
    return rows, b.one("Reshape", [inverse_flat, shape], "inverse"), shape


def _or_labelled(b: _Builder, keep: str, labels: list[tuple[str, int]]) -> str:
    """Nodes computing ``keep`` (flat; ``""`` for none) or each loss's counted labels."""
    for labels_name, ignore in labels:
        ignored = b.one(
            "Equal", [labels_name, b.const("ignore", np.array(ignore, np.int64))], "ignored"
        )
        counted = b.one("Not", [ignored], "labelled")
        keep = b.one("Or", [keep, counted], "keep_labelled") if keep else counted
    return keep


def _kept_rows(b: _Builder, keep: str) -> tuple[str, str]:
    """Nodes computing the flat positions ``keep`` marks (row indices [kept]) and the inverse
    index (flat position -> kept row, or the number of kept rows for a position left out)."""
    rows = b.one(
        "Squeeze",
        [b.one("NonZero", [keep], "kept"), b.const("axis0", np.array([0], np.int64))],
        "rows",
    )
    position = b.one(
        "Sub",
        [
            b.one(
                "CumSum",
                [
                    b.one("Cast", [keep], "keep_int", to=onnx.TensorProto.INT64),
                    b.const("axis0s", np.array(0, np.int64)),
                ],
                "running",
            ),
            b.const("one", np.array(1, np.int64)),
        ],
        "position",
    )
    count = b.one("Shape", [rows], "kept_count")
    return rows, b.one("Where", [keep, position, count], "inverse_flat")


def _loss_grids(graph: onnx.GraphProto, producer: Mapping[str, onnx.NodeProto]) -> list[str]:
    """The ``logits`` of each ``SoftmaxCrossEntropyLoss(reshape(logits, (-1, classes)), ...)``."""
    found = []
    for node in graph.node:
        reshape = producer.get(node.input[0]) if node.op_type == "SoftmaxCrossEntropyLoss" else None
        if reshape is not None and reshape.op_type == "Reshape":
            found.append(reshape.input[0])
    return found


def _loss_cone(
    graph: onnx.GraphProto,
    producer: Mapping[str, onnx.NodeProto],
    consumers: Mapping[str, list[onnx.NodeProto]],
    user_inputs: set[str] | frozenset[str],
) -> list[str]:
    """The tensors labelled rows reads: those of the nodes from each loss's logits back to the
    first that cannot be token-wise whatever the shapes (attention, say), their readers'
    outputs, the losses' inputs and the graph's outputs."""
    params = {vi.name for vi in graph.input if vi.name not in user_inputs}
    params |= {t.name for t in graph.initializer}
    aten_token_wise = {"gelu", GELU, LAYER_NORM}
    maybe = _ELEMENTWISE | {"Dropout", "Slice", "Split", "LayerNormalization", "Softmax"}

    def _weight(name: str) -> bool:
        """A parameter, or a transposed one (a ``Linear`` exported as ``MatMul``)."""
        writer = producer.get(name)
        if writer is not None and writer.op_type == "Transpose":
            name = writer.input[0]
        return name in params

    cone: list[onnx.NodeProto] = []
    names: set[str] = set()
    stack = list(_loss_grids(graph, producer))
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if name in names or node is None:
            continue
        names.add(name)
        kind = attribute(node, "operator", "") if node.domain == ATEN_DOMAIN else node.op_type
        if (
            kind in maybe
            or kind in aten_token_wise
            or (kind == "MatMul" and len(node.input) == 2 and _weight(node.input[1]))
        ):
            cone.append(node)
            stack.extend(node.input)
    for node in cone:
        names.update(i for i in node.input if i)
        for out in node.output:
            for reader in consumers.get(out, []):
                names.update(o for o in reader.output if o)
    for node in graph.node:
        if node.op_type == "SoftmaxCrossEntropyLoss":
            names.update(i for i in node.input if i)
    names.update(o.name for o in graph.output)  # the check of the rewrite compares them
    return sorted(names)


def _labelled_indices(b: _Builder, labels: list[tuple[str, int]]) -> tuple[str, str]:
    """Nodes computing the rows of the tokens any loss counts: (row indices [kept], inverse
    index [batch * seq]: flat position -> kept row, or the number of kept rows)."""
    keep = _or_labelled(b, "", labels)
    # a batch without a single label keeps its first token: no empty tensors (the engine's
    # kernels fail on some), and the ignored label adds nothing to the loss
    counts = b.one("Cast", [keep], "keep_count", to=onnx.TensorProto.INT64)
    none = b.one(
        "Equal",
        [
            b.one("ReduceMax", [counts], "any_label", keepdims=0),
            b.const("zero", np.array(0, np.int64)),
        ],
        "no_label",
    )
    first = b.one(
        "Equal",
        [
            b.one(
                "Range",
                [
                    b.const("zero_pos", np.array(0, np.int64)),
                    b.one("Size", [keep], "tokens"),
                    b.const("step", np.array(1, np.int64)),
                ],
                "positions",
            ),
            b.const("zero_i64", np.array(0, np.int64)),
        ],
        "is_first",
    )
    keep = b.one("Or", [keep, b.one("And", [first, none], "first_if_none")], "keep_some")
    return _kept_rows(b, keep)


Loss = tuple[onnx.NodeProto, str, int]


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
    region: _Region
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
            raise _Refused(
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
    """The region, the losses and the kept tokens on this batch, or :class:`_Refused`."""
    graph = model.graph
    calls = sorted({attribute(n, "func_name", "?") for n in graph.node if n.op_type == "PythonOp"})
    if calls:
        # the checks run the forward graph; the user's Python code must not run outside a step
        raise _Refused(f"the graph calls Python code (PythonOp {', '.join(calls)})")
    producer, consumers = producers_and_consumers(graph)
    masks, source = _attention_masks(graph, producer, user_inputs, labels_only)
    # labelled rows reads the tensors near the losses only: holding every activation of the
    # forward (the padding elimination's view) cost the benchmark masked LM 130 MiB of peak
    # memory at graph build
    values = evaluate_graph(
        model,
        feeds,
        outputs=_loss_cone(graph, producer, consumers, user_inputs) if labels_only else None,
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
        raise _Refused(f"{density:.1%} of the tokens are kept, not under {threshold:.0%}")
    if not labels_only:
        _check_masked(values, masks, dropped)
        rng = np.random.default_rng(0)
        probe_mask = (rng.random(grid) < 0.7).astype(mask_value.dtype)
        probe_mask[:, 0] = 1
        probe_values = evaluate_graph(
            model, {**feeds, source: probe_mask}, outputs=masks, types=types
        )
        _check_masked(probe_values, masks, probe_mask == 0)
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
        if not _loss_grids(graph, producer):
            raise _Refused("no cross-entropy loss reads reshape(logits, (-1, classes))")
        return [], ""
    attention = [
        n
        for n in graph.node
        if n.domain == ATEN_DOMAIN and attribute(n, "operator", "") in _ATTENTION
    ]
    if not attention:
        raise _Refused("no fused attention node (ORTMODULE_FUSED_ATTENTION) reads a padding mask")
    masks = [n.input[5] if len(n.input) > 5 else "" for n in attention]
    if "" in masks:
        raise _Refused("an attention node has no mask, so padding tokens are attended to")
    return masks, _mask_source(graph, masks, user_inputs)


def _grid(
    graph: onnx.GraphProto,
    producer: Mapping[str, onnx.NodeProto],
    values: Mapping[str, Any],
    source: str,
    labels_only: bool,
) -> tuple[tuple[int, int], np.ndarray]:
    """The (batch, seq) of the tokens, and the mask of the kept ones (all ones for labels)."""
    if labels_only:
        grid_of = {tuple(values[name].shape[:2]) for name in _loss_grids(graph, producer)}
        if len(grid_of) != 1:
            raise _Refused(f"the losses' logits have (batch, seq) dims {sorted(grid_of)}")
        ((rows_grid, cols_grid),) = grid_of
        grid = (int(rows_grid), int(cols_grid))
        return grid, np.ones(grid, dtype=np.int64)
    mask_value = values[source]
    if mask_value.ndim != 2:
        raise _Refused(f"the attention mask input {source} has rank {mask_value.ndim}, not 2")
    return (int(mask_value.shape[0]), int(mask_value.shape[1])), mask_value


def _pruned_region(
    graph: onnx.GraphProto,
    values: Mapping[str, Any],
    grid: tuple[int, int],
    producer: Mapping[str, onnx.NodeProto],
    consumers: Mapping[str, list[onnx.NodeProto]],
    labels_only: bool,
) -> tuple[_Region, list[Loss], set[str], dict[int, int], set[int]]:
    """The token-wise region, pruned until none of its tensors leaks where the padded tokens
    are read: the node writing a leaking tensor computes on the padded tokens, as exported."""
    # every initializer as an array: once, not in each round of the pruning below
    constants = constant_values(graph)
    outputs = {o.name for o in graph.output}
    region = _region(graph, values, constants, grid)
    first_leak = ""
    while True:
        losses, absorbed = _losses(graph, region, values, grid, producer, consumers)
        picks = {} if labels_only else _picks(graph, region, values, constants)
        scatter, shapes = _exits(region, absorbed, picks, consumers, outputs)
        leak = _leak(scatter, region, consumers, values, grid, outputs, not labels_only)
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
            raise _Refused(f"no token-wise node can skip {skipped}: {first_leak}")
    if labels_only and not losses:
        raise _Refused(f"no token-wise node feeds only a loss: {first_leak}")
    return region, losses, absorbed, picks, shapes


def _rewrite(graph: onnx.GraphProto, plan: _Plan) -> tuple[int, int]:
    """Token-wise nodes on the kept rows: their token inputs gathered, their outputs read
    elsewhere scattered back; the losses on the kept rows. Returns (gathers, scatters)."""
    labels_only, values, region, grid = plan.labels_only, plan.values, plan.region, plan.grid
    losses, picks, shapes, absorbed = plan.losses, plan.picks, plan.shapes, plan.absorbed
    region_nodes = {id(n) for n in region.nodes}
    loss_nodes = {id(node) for node, _, _ in losses}
    b = _Builder(_LABEL_PREFIX if labels_only else _PREFIX)
    label_sets = [(n.input[1], ig) for n, _, ig in losses]
    if labels_only:
        rows, inverse = _labelled_indices(b, label_sets)
        # the padded (batch, seq) from a tensor entering the region
        entering = sorted(
            name
            for n in region.nodes
            for name in n.input
            if name and name not in region.flat and _token_tensor(values, name, grid)
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
        rows, inverse, mask_shape = _indices(
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
                if name and name not in region.flat and _token_tensor(values, name, grid):
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
        new_nodes = [
            _routed_loss(node, values, int(plan.labelled.sum()), b, infos)
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
    b: _Builder,
    infos: list[onnx.ValueInfoProto],
) -> onnx.NodeProto:
    """``loss`` on PyTorch's kernel where kernel choice times it faster at the labelled rows'
    size (the exported graph left the engine's node for the engine's label sparsity)."""
    logits = values[loss.input[0]]  # as computed before the rewrite: (batch, seq, classes)
    classes = int(logits.shape[-1])
    if (
        len(loss.input) != 2  # class weights: the engine's node
        or logits.dtype != np.float32
        or cross_entropy_route(rows, classes) != "torch"
    ):
        return loss
    node, params = aten_cross_entropy(loss)
    b.initializers.append(params)
    elem = onnx.TensorProto.FLOAT
    infos.append(onnx.helper.make_tensor_value_info(node.output[0], elem, []))
    infos.append(onnx.helper.make_tensor_value_info(node.output[1], elem, [LABELLED, classes]))
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
        raise _Refused("the rewritten graph has a cycle")
    return [nodes[k] for k in order]


def _losses(
    graph: onnx.GraphProto,
    region: _Region,
    values: Mapping[str, np.ndarray],
    grid: tuple[int, int],
    producer: Mapping[str, onnx.NodeProto],
    consumers: Mapping[str, list[onnx.NodeProto]],
) -> tuple[list[tuple[onnx.NodeProto, str, int]], set[str]]:
    """Losses ``SCE(reshape(tokens, (-1, V)), labels)`` on a region tensor: (loss, tokens,
    ignore_index) each, and the ``Reshape`` nodes only such a loss reads (left out)."""
    rows = grid[0] * grid[1]
    losses: list[tuple[onnx.NodeProto, str, int]] = []
    absorbed: set[str] = set()
    for node in graph.node:
        if node.op_type != "SoftmaxCrossEntropyLoss":
            continue
        ignore = attribute(node, "ignore_index")
        reshape = producer.get(node.input[0])
        labels = values.get(node.input[1])
        if (
            attribute(node, "reduction", "mean") not in ("mean", "sum")
            or ignore is None
            or reshape is None
            or reshape.op_type != "Reshape"
            or labels is None
            or labels.shape != (rows,)
            or reshape.input[0] not in region.flat
            or values[reshape.output[0]].shape != (rows, values[reshape.input[0]].shape[-1])
            or (len(node.output) > 1 and node.output[1] and consumers.get(node.output[1]))
        ):
            continue
        losses.append((node, reshape.input[0], int(ignore)))
        if all(c is node for c in consumers.get(reshape.output[0], [])):
            absorbed.add(reshape.name)
    return losses, absorbed


def _picks(
    graph: onnx.GraphProto,
    region: _Region,
    values: Mapping[str, np.ndarray],
    constants: Mapping[str, np.ndarray],
) -> dict[int, int]:
    """``x[:, i]`` of a region tensor at a constant position ``i >= 0`` (a classifier's first
    token): node id -> ``i``. Those rows are kept, and the pick reads them from the rows."""
    picks: dict[int, int] = {}
    for node in graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        index = constants.get(node.input[1]) if len(node.input) > 1 else None
        rank = values[node.input[0]].ndim if node.input[0] in values else 0
        if (
            node.input[0] in region.flat
            and index is not None
            and index.ndim == 0
            and int(index) >= 0
            and attribute(node, "axis", 0) % max(rank, 1) == 1
        ):
            picks[id(node)] = int(index)
    return picks


def _exits(
    region: _Region,
    absorbed: set[str],
    picks: Mapping[int, int],
    consumers: Mapping[str, list[onnx.NodeProto]],
    outputs: set[str],
) -> tuple[set[str], set[int]]:
    """Region tensors read outside the region (scattered back to the padded layout), and the
    ``Shape`` nodes of region tensors (given the padded shape instead)."""
    region_nodes = {id(n) for n in region.nodes}
    scatter: set[str] = set()
    shapes: set[int] = set()
    for name in sorted(region.flat):
        if name in outputs:
            scatter.add(name)
        for reader in consumers.get(name, []):
            if id(reader) in region_nodes or reader.name in absorbed or id(reader) in picks:
                continue
            if reader.op_type == "Shape" and not reader.attribute:
                shapes.add(id(reader))
            else:
                scatter.add(name)
    return scatter, shapes


def _token_axis(node: onnx.NodeProto, letter: str) -> int:
    """The token axis of attention input/output ``letter`` (q, k, v, o): 1 where the node reads
    it token-major (FLASH_BSHD's overload lists it), else 2 (batch, heads, tokens, dim)."""
    flags = (
        attribute(node, "overload_name", "")
        if attribute(node, "operator", "") == FLASH_BSHD
        else ""
    )
    return 1 if letter in flags else 2


def _leak(
    scatter: set[str],
    region: _Region,
    consumers: Mapping[str, list[onnx.NodeProto]],
    values: Mapping[str, np.ndarray],
    grid: tuple[int, int],
    outputs: set[str],
    attention_ok: bool = True,
) -> tuple[str, str] | None:
    """Whether scattered tensors (zeros at left-out rows) reach only layout nodes that keep track
    of the ``(batch, seq)`` axes, attention (as query, key or value, on its token axis; only
    with ``attention_ok``, where the left-out keys are masked) and gathers back into the
    region. Else the scattered tensor that leaks and why."""
    region_nodes = {id(n) for n in region.nodes}
    # a tensor with zeros at left-out tokens, and the axes its (batch, seq) are on
    stack: list[tuple[str, tuple[int, int], str]] = [
        (name, (0, 1), name) for name in sorted(scatter)
    ]
    seen: set[str] = set()
    while stack:
        name, axes, origin = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in outputs:
            if not attention_ok:
                return origin, f"{name} is a graph output, so each of its rows is computed"
            return origin, f"the graph output {name} would have zeros at padding tokens"
        for reader in consumers.get(name, []):
            if reader.op_type in _SHAPE_ONLY:
                continue
            if id(reader) in region_nodes and axes == (0, 1):
                continue  # gathered back into the region: the left-out rows are dropped
            kind = (
                attribute(reader, "operator", "")
                if reader.domain == ATEN_DOMAIN
                else reader.op_type
            )
            if (
                attention_ok
                and kind in _ATTENTION
                and name in reader.input[:3]
                and name not in reader.input[3:]
            ):
                letter = "qkv"[list(reader.input).index(name)]
                if axes != (0, _token_axis(reader, letter)):
                    return origin, f"{name} reaches attention {reader.name} off its token axis"
                stack.append((reader.output[0], (0, _token_axis(reader, "o")), origin))
                if len(reader.output) > 1 and reader.output[1]:
                    # the log-sum-exp: (batch, heads, seq)
                    stack.append((reader.output[1], (0, 2), origin))
                continue
            if kind == "Transpose" and reader.input[0] == name:
                perm = list(attribute(reader, "perm", []))
                if perm:
                    moved = (perm.index(axes[0]), perm.index(axes[1]))
                    stack.append((reader.output[0], moved, origin))
                    continue
            elif kind in _LAYOUT and reader.input[0] == name:
                # row-major: the axes up to the token axis keep their meaning when the output
                # starts with the same dims
                keep = max(axes) + 1
                before, after = values[name].shape, values[reader.output[0]].shape
                if tuple(after[:keep]) == tuple(before[:keep]):
                    stack.append((reader.output[0], axes, origin))
                    continue
            return origin, f"the left-out rows of {name} reach {kind} {reader.name}"
    return None
