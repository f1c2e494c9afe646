"""The token-wise region of a forward graph and what may leave it: the analysis behind padding
elimination and labelled rows (:mod:`ortmodule_exporter.sparsity.padding`). Which nodes treat
each token on its own (:func:`token_wise`, :func:`token_region`), the losses and the position
picks that read the region, where its tensors exit and whether one leaks where a padded row
would be read (:func:`region_leak`), and the attention masks' checks. A refusal is
:class:`Refused`, with the reason.

>>> from ortmodule_exporter.sparsity.token_region import Refused, token_region
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper

from ..aten.attention_layout import FLASH, FLASH_BSHD
from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import GELU, LAYER_NORM
from ..onnx_graph import attribute
from .density import _cone

__all__ = [
    "ATTENTION_OPS",
    "MASKED",
    "Loss",
    "Refused",
    "Region",
    "check_masked",
    "loss_cone",
    "loss_grids",
    "mask_source",
    "position_picks",
    "region_exits",
    "region_leak",
    "token_losses",
    "token_region",
    "token_tensor",
    "token_wise",
]


#: an additive attention mask at or below this gives the key a softmax weight of exactly 0
MASKED = -1e30


ATTENTION_OPS = frozenset({FLASH, FLASH_BSHD})


#: ONNX operators that act on each element alone (any extra inputs must be scalars or vectors)
_ELEMENTWISE = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Relu", "Tanh", "Sigmoid", "Erf", "Neg", "Sqrt",
        "Exp", "Log", "Abs", "Cast", "Identity", "Softplus", "LeakyRelu", "Elu", "Selu",
        "HardSigmoid", "Softsign", "Reciprocal", "Gelu", "FastGelu", "QuickGelu", "BiasGelu",
    }
)  # fmt: skip


#: ATen operators of one input that act on each element alone: GELU's, and the sigmoid and tanh
#: PyTorch runs for the engine's (passes/saturating_tails.py)
_ATEN_ELEMENTWISE = frozenset({"gelu", GELU, "sigmoid", "tanh"})


_LAYOUT = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Cast"})


_SHAPE_ONLY = frozenset({"Shape", "Size"})


class Refused(Exception):
    """Why the pass leaves the graph as it is."""


def mask_source(
    graph: onnx.GraphProto, masks: list[str], user_inputs: set[str] | frozenset[str]
) -> str:
    """The one user input every attention mask is computed from (shapes aside)."""
    sources: set[str] = set()
    for mask in masks:
        _, found = _cone(graph, mask, stop=_SHAPE_ONLY)  # values, not shapes
        if not found or not found <= user_inputs:
            others = sorted(found - set(user_inputs))
            raise Refused(
                f"the attention mask {mask} is not computed from the user's inputs alone "
                f"(it reads {', '.join(others) or 'no input'})"
            )
        sources |= found
    if len(sources) != 1:
        raise Refused(f"the attention masks come from {sorted(sources)}, not from one input")
    return next(iter(sources))


def check_masked(values: Mapping[str, np.ndarray], masks: list[str], dropped: np.ndarray) -> None:
    """Every key in ``dropped`` (batch, seq) is masked to a softmax weight of 0 in each mask."""
    batch, seq = dropped.shape
    for mask in masks:
        value = values[mask]
        if value.ndim != 4 or value.shape[0] not in (1, batch) or value.shape[-1] != seq:
            raise Refused(
                f"the attention mask {mask} has shape {value.shape}, not (batch, ., ., seq)"
            )
        full = np.broadcast_to(value, (batch, *value.shape[1:]))
        keys = np.moveaxis(full, -1, 1)[dropped]  # (dropped keys, heads, queries)
        if keys.size and not (keys <= MASKED).all():
            raise Refused(f"the attention mask {mask} does not mask every padding token")


@dataclass
class Region:
    """The token-wise nodes and the tensors they compute as (kept tokens, ...) rows."""

    nodes: list[onnx.NodeProto]
    flat: set[str]


def token_tensor(values: Mapping[str, np.ndarray], name: str, grid: tuple[int, int]) -> bool:
    value = values.get(name)
    return value is not None and value.ndim >= 3 and tuple(value.shape[:2]) == grid


def _small(
    values: Mapping[str, np.ndarray], constants: Mapping[str, np.ndarray], name: str, rank: int
) -> bool:
    value = values.get(name)
    if value is None:
        value = constants.get(name)
    return name == "" or (value is not None and value.ndim <= rank)


def _feature_axes(axes: np.ndarray | None, rank: int) -> bool:
    """Whether ``axes`` are constant and all feature axes: none is batch or seq."""
    return axes is not None and all(int(a) % rank >= 2 for a in axes.reshape(-1))


def token_wise(
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    constants: Mapping[str, np.ndarray],
    grid: tuple[int, int],
) -> bool:
    """Whether ``node`` computes each token's row from that token's rows alone."""
    tokens = [i for i in node.input if token_tensor(values, i, grid)]
    if not tokens or not token_tensor(values, node.output[0], grid):
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
                and _feature_axes(axes, rank)
                and all(token_tensor(values, o, grid) for o in node.output if o)
                and all(_small(values, constants, i, 1) for _, i in others)
            )
        if node.op_type == "ReduceMean":
            # over feature axes only, dims kept: a float32 layer norm's centring
            # (symbolics.normalization: x - mean(x) before its LayerNormalization)
            rank = values[node.input[0]].ndim
            found = constants.get(node.input[1]) if len(node.input) > 1 else None
            axes = found if found is not None else np.array(attribute(node, "axes", []))
            return (
                node.input[0] in tokens
                and len(tokens) == 1
                and attribute(node, "keepdims", 1) == 1
                and axes.size > 0
                and _feature_axes(axes, rank)
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
        if operator in _ATEN_ELEMENTWISE:
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


def token_region(
    graph: onnx.GraphProto,
    values: Mapping[str, np.ndarray],
    constants: Mapping[str, np.ndarray],
    grid: tuple[int, int],
) -> Region:
    nodes = [n for n in graph.node if token_wise(n, values, constants, grid)]
    flat = {o for n in nodes for o in n.output if o}
    return Region(nodes, flat)


def loss_grids(graph: onnx.GraphProto, producer: Mapping[str, onnx.NodeProto]) -> list[str]:
    """The ``logits`` of each ``SoftmaxCrossEntropyLoss(reshape(logits, (-1, classes)), ...)``."""
    found = []
    for node in graph.node:
        reshape = producer.get(node.input[0]) if node.op_type == "SoftmaxCrossEntropyLoss" else None
        if reshape is not None and reshape.op_type == "Reshape":
            found.append(reshape.input[0])
    return found


def loss_cone(
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
    aten_token_wise = {*_ATEN_ELEMENTWISE, LAYER_NORM}
    maybe = _ELEMENTWISE | {"Dropout", "Slice", "Split", "LayerNormalization", "Softmax"}

    def _weight(name: str) -> bool:
        """A parameter, or a transposed one (a ``Linear`` exported as ``MatMul``)."""
        writer = producer.get(name)
        if writer is not None and writer.op_type == "Transpose":
            name = writer.input[0]
        return name in params

    cone: list[onnx.NodeProto] = []
    names: set[str] = set()
    stack = list(loss_grids(graph, producer))
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


Loss = tuple[onnx.NodeProto, str, int]


def token_losses(
    graph: onnx.GraphProto,
    region: Region,
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


def position_picks(
    graph: onnx.GraphProto,
    region: Region,
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


def region_exits(
    region: Region,
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


def region_leak(
    scatter: set[str],
    region: Region,
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
                and kind in ATTENTION_OPS
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
