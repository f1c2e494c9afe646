"""Label density: find the loss's label input, measure how many labels count, flag it for the engine.

A masked-LM batch labels about 15% of its tokens; the rest carry ``ignore_index``. The engine's
compute optimizer can drop the ignored rows before ``SoftmaxCrossEntropyLoss`` (and, through its
upstream-gather pass, before the vocabulary projection that feeds it) when the loss's label
input comes straight from a ``com.microsoft::PythonOp`` whose ``func_name`` is
:data:`ENGINE_FLAG`. This module builds that flag:

* :func:`label_sites` finds each ``SoftmaxCrossEntropyLoss`` the engine can shrink (scalar
  reduction, an ``ignore_index``, unused ``log_prob``);
* :func:`site_labels` computes the labels the loss reads on a real batch, by running the part of
  the graph that produces them from the user's inputs, and :func:`label_density` the fraction
  that count;
* :func:`insert_density_flag` puts the flag PythonOp in front of the loss's label input. The
  engine removes it again when it applies the optimization, unless the node also prints the
  density of every step (then it stays and runs :class:`DensityFlag`). :data:`PRINT_ONLY` names
  the same Function under a name the engine does not act on: it prints without changing the
  computation;
* the engine's gather insertion also needs named dims on every tensor (it fails on unnamed
  dynamic dims): :func:`ortmodule_exporter.named_dims.infer_symbolic_shapes` gives them.

Only the name string is shared with the engine; nothing from another Python package is used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch

from ..onnx_graph import attribute, import_domain
from ..python_op import runner as python_op_runner
from ..python_op.registry import PYTHON_OP_DOMAIN, REGISTRY, python_op_node
from .label_density import DENSITY_THRESHOLD, label_density

__all__ = [
    "DENSITY_THRESHOLD",
    "ENGINE_FLAG",
    "PRINT_ONLY",
    "DensityFlag",
    "EmbeddingSite",
    "LabelSite",
    "density_flags",
    "embedding_sites",
    "insert_embedding_density_print",
    "insert_density_flag",
    "label_density",
    "label_sites",
    "site_labels",
    "tensor_value",
    "strip_density_flags",
]

logger = logging.getLogger("ortmodule.density")

#: the ``func_name`` the engine's InsertGatherBeforeSceLoss transformer looks for
ENGINE_FLAG = "onnxruntime.training.ortmodule._runtime_inspector.FlagAndPrintDensity"
#: the same Function under a name the engine leaves alone: print only, no graph change
PRINT_ONLY = "ortmodule_exporter.density.PrintDensity"
_SCE = "SoftmaxCrossEntropyLoss"


@dataclass(frozen=True)
class LabelSite:
    """One loss node whose ignored labels the engine can drop."""

    node: str  #: the SoftmaxCrossEntropyLoss node's name
    labels: str  #: the tensor it reads labels from
    ignore_index: int
    reduction: str
    #: the user inputs the labels are computed from (graph input names)
    sources: tuple[str, ...]


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def _cone(
    graph: onnx.GraphProto,
    tensor: str,
    producer: Mapping[str, onnx.NodeProto] | None = None,
    stop: frozenset[str] = frozenset(),
) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes computing ``tensor`` (in graph order) and the graph inputs they read; the
    inputs of ``stop`` operators (``Shape``, say, to follow values only) are not followed."""
    producer = producer if producer is not None else _producers(graph)
    inputs = {vi.name for vi in graph.input}
    needed: set[int] = set()
    sources: set[str] = set()
    stack = [tensor]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in inputs:
            sources.add(name)
            continue
        node = producer.get(name)
        if node is None:
            continue  # an initializer
        needed.add(id(node))
        if node.op_type in stop:
            continue
        stack.extend(node.input)
        for a in node.attribute:  # names a subgraph reads from the outer scope
            if a.type == onnx.AttributeProto.GRAPH:
                stack.extend(i for n in a.g.node for i in n.input)
    return [n for n in graph.node if id(n) in needed], sources


def label_sites(model: onnx.ModelProto) -> list[LabelSite]:
    """The ``SoftmaxCrossEntropyLoss`` nodes the engine can shrink to the labels that count.

    The engine's conditions: reduction ``mean`` or ``sum`` (a scalar loss), an ``ignore_index``
    and a ``log_prob`` output that nothing reads. Nodes already flagged are skipped.
    """
    graph = model.graph
    outputs = {o.name for o in graph.output}
    consumed = {i for n in graph.node for i in n.input}
    producer = _producers(graph)
    sites = []
    for node in graph.node:
        if node.op_type != _SCE or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        ignore_index = attribute(node, "ignore_index")
        reduction = attribute(node, "reduction", "mean")
        if ignore_index is None or reduction not in ("mean", "sum"):
            continue
        if len(node.output) > 1 and (node.output[1] in outputs or node.output[1] in consumed):
            continue
        labels = node.input[1]
        feeding = producer.get(labels)
        if feeding is not None and attribute(feeding, "func_name") in (ENGINE_FLAG, PRINT_ONLY):
            continue
        _, sources = _cone(graph, labels, producer)
        sites.append(
            LabelSite(node.name, labels, int(ignore_index), reduction, tuple(sorted(sources)))
        )
    return sites


def tensor_value(
    model: onnx.ModelProto, tensor: str, feeds: Mapping[str, Any]
) -> np.ndarray | None:
    """The value ``tensor`` takes for this batch, if the user's inputs alone determine it.

    Runs the nodes between the inputs (``feeds``, by graph input name) and ``tensor`` with ONNX's
    reference evaluator. ``None`` when ``tensor`` depends on anything else (parameters, a custom
    operator) or the evaluator cannot run those nodes.
    """
    graph = model.graph
    nodes, sources = _cone(graph, tensor)
    if not sources <= set(feeds):
        return None
    if any(n.domain not in ("", "ai.onnx") for n in nodes):
        return None
    values: dict[str, np.ndarray] = {}
    for name in sources:
        value = feeds[name]
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        values[name] = np.asarray(value)
    if not nodes:
        return values.get(tensor)
    from onnx.reference import ReferenceEvaluator

    initializers = {i.name: i for i in graph.initializer}
    used = {i for n in nodes for i in n.input}
    sub = onnx.helper.make_graph(
        nodes,
        "value",
        [vi for vi in graph.input if vi.name in sources],
        [onnx.helper.make_empty_tensor_value_info(tensor)],
        initializer=[initializers[n] for n in used if n in initializers],
    )
    sub_model = onnx.helper.make_model(sub, opset_imports=list(model.opset_import))
    sub_model.ir_version = model.ir_version
    try:
        (value,) = ReferenceEvaluator(sub_model).run(None, values)
    except Exception as err:  # noqa: BLE001 - a reference-evaluator gap: just skip the tensor
        logger.debug("value of %s not computed: %s", tensor, err)
        return None
    return np.asarray(value)


def site_labels(
    model: onnx.ModelProto, site: LabelSite, feeds: Mapping[str, Any]
) -> np.ndarray | None:
    """The labels ``site``'s loss reads for this batch (see :func:`tensor_value`)."""
    return tensor_value(model, site.labels, feeds)


# -- the flag's Function ------------------------------------------------------------------------------


@dataclass
class _Printed:
    kind: str  # LABEL or EMBED
    name: str  # the user inputs it comes from
    ignored: str  # what the skipped value is called: ignore_index or padding_idx
    steps: int = 0


_SITES: dict[int, _Printed] = {}
_SITES_LOCK = threading.Lock()


class DensityFlag(torch.autograd.Function):
    """Returns its input unchanged; with ``emit`` logs its density (one line per step).

    The density is the fraction of entries that are not ``ignored`` (a loss's ``ignore_index``
    or an embedding's ``padding_idx``).
    """

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, ignored: int, emit: int, site: int) -> Any:  # type: ignore[override]
        if emit:
            total = values.numel()
            valid = int(torch.count_nonzero(values != ignored)) if total else 0
            with _SITES_LOCK:
                printed = _SITES.get(site) or _Printed("LABEL", "labels", "ignore_index")
                step = printed.steps
                printed.steps += 1
            logger.warning(
                "input density, step %d: %s %s (%s %d): %.2f %% (%d of %d)",
                step,
                printed.kind,
                printed.name,
                printed.ignored,
                ignored,
                100.0 * valid / total if total else 0.0,
                valid,
                total,
            )
        ctx.mark_non_differentiable(values)
        return values

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - integers take no gradient
        return None, None, None, None


def _insert_flag(
    model: onnx.ModelProto,
    tensor: str,
    printed: _Printed,
    ignored: int,
    *,
    engine: bool,
    emit: bool,
    rank: int,
    node_name: str,
) -> str:
    """A flag PythonOp on ``tensor``, placed before its first reader; returns the flagged name.

    The caller rewires the readers that should see the flag's output."""
    graph = model.graph
    entry = REGISTRY.register(DensityFlag, name=ENGINE_FLAG if engine else PRINT_ONLY)
    if emit:
        python_op_runner.install()
    with _SITES_LOCK:
        site_id = len(_SITES)
        _SITES[site_id] = printed
    flagged = f"{tensor}/density_flag_{site_id}"
    flag = python_op_node(
        entry,
        [tensor],
        [f"{flagged}/ctx", flagged],
        name=node_name,
        convention="dccc",
        types=([onnx.TensorProto.INT64], [onnx.TensorProto.INT64]),
        ranks=([rank], [rank]),
        training=True,
        scalars={"int": ([ignored, int(emit), site_id], [1, 2, 3])},
    )
    first = next(i for i, n in enumerate(graph.node) if tensor in n.input)
    graph.node.insert(first, flag)
    import_domain(model, PYTHON_OP_DOMAIN)
    return flagged


def _source_names(sources: tuple[str, ...], fallback: str) -> str:
    return ",".join(s.removeprefix("input.") for s in sources) or fallback


def insert_density_flag(
    model: onnx.ModelProto,
    site: LabelSite,
    *,
    engine: bool,
    emit: bool,
    rank: int = 1,
    every_reader: bool = False,
) -> str:
    """Put the density flag PythonOp between ``site``'s labels and its loss node.

    ``engine`` names it :data:`ENGINE_FLAG` (the engine drops ignored labels and removes the node
    unless ``emit``), else :data:`PRINT_ONLY`. ``emit`` makes it log the density of each step.
    ``rank`` is the labels' rank (the engine only shrinks rank-1 labels). ``every_reader``
    (print only): every reader of ``site.labels`` reads the flag's output, not just the loss
    (labels that reach the loss through other nodes). Returns the flag node's name.
    """
    (loss,) = [n for n in model.graph.node if n.name == site.node]
    readers = [n for n in model.graph.node if site.labels in n.input] if every_reader else [loss]
    node_name = f"{site.node}/density_flag"
    printed = _Printed("LABEL", _source_names(site.sources, site.labels), "ignore_index")
    flagged = _insert_flag(
        model,
        site.labels,
        printed,
        site.ignore_index,
        engine=engine,
        emit=emit,
        rank=rank,
        node_name=node_name,
    )
    for reader in readers:
        for k, name in enumerate(reader.input):
            if name == site.labels and reader.name != node_name:
                reader.input[k] = flagged
    if len(loss.output) < 2:  # the engine reads the log_prob output's name
        loss.output.append(f"{site.node}/log_prob_unused")
    return node_name


# -- embeddings: density printed only ---------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddingSite:
    """One embedding lookup with a ``padding_idx``: the indices it reads and the padding id."""

    node: str  #: the Gather node's name
    indices: str
    padding_idx: int
    sources: tuple[str, ...]


def _int_constant(graph: onnx.GraphProto, name: str) -> int | None:
    for init in graph.initializer:
        if init.name == name:
            value = onnx.numpy_helper.to_array(init)
            return int(value) if value.size == 1 and value.dtype.kind in "iu" else None
    for node in graph.node:
        if node.op_type == "Constant" and name in node.output:
            tensor = attribute(node, "value")
            if tensor is None:
                return None
            value = onnx.numpy_helper.to_array(tensor)
            return int(value) if value.size == 1 and value.dtype.kind in "iu" else None
    return None


def embedding_sites(
    model: onnx.ModelProto, param_names: set[str] | frozenset[str]
) -> list[EmbeddingSite]:
    """Embedding lookups (``Gather`` of a parameter by indices from the inputs) with a padding id.

    The exporter compares the indices with ``padding_idx`` (to keep the padding row's gradient
    zero), which is where the padding id is read from; lookups without one are skipped.
    """
    graph = model.graph
    producer = _producers(graph)
    # indices -> the constants they are compared with (the padding id, where there is one)
    compared: dict[str, list[str]] = {}
    for other in graph.node:
        if other.op_type == "Equal" and len(other.input) == 2:
            compared.setdefault(other.input[0], []).append(other.input[1])
    sites = []
    for node in graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        weight, indices = node.input[0], node.input[1]
        if weight not in param_names:
            continue
        feeding = producer.get(indices)
        if feeding is not None and attribute(feeding, "func_name") in (ENGINE_FLAG, PRINT_ONLY):
            continue
        constants = (_int_constant(graph, c) for c in compared.get(indices, ()))
        padding = next((c for c in constants if c is not None), None)
        if padding is None:
            continue
        _, sources = _cone(graph, indices, producer)
        sites.append(EmbeddingSite(node.name, indices, padding, tuple(sorted(sources))))
    return sites


def insert_embedding_density_print(model: onnx.ModelProto, site: EmbeddingSite, rank: int) -> str:
    """A flag that logs the density (entries not ``padding_idx``) of ``site``'s indices each step.

    Named :data:`PRINT_ONLY`: the engine does not change the graph for it. Every reader of the
    indices reads the flag's (identical) output, so the node stays in the graph.
    """
    node_name = f"{site.node}/density_flag"
    printed = _Printed("EMBED", _source_names(site.sources, site.indices), "padding_idx")
    flagged = _insert_flag(
        model,
        site.indices,
        printed,
        site.padding_idx,
        engine=False,
        emit=True,
        rank=rank,
        node_name=node_name,
    )
    for node in model.graph.node:
        if node.name == node_name:
            continue
        for i, name in enumerate(node.input):
            if name == site.indices:
                node.input[i] = flagged
    return node_name


def density_flags(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The density flag nodes in ``model``."""
    return [
        n
        for n in model.graph.node
        if n.op_type == "PythonOp"
        and n.domain == PYTHON_OP_DOMAIN
        and attribute(n, "func_name") in (ENGINE_FLAG, PRINT_ONLY)
    ]


def strip_density_flags(model: onnx.ModelProto, keep_printing: bool = True) -> int:
    """Remove the :data:`ENGINE_FLAG` nodes (those that print stay when ``keep_printing``).

    Used when the engine builds a graph without its compute optimizer, where a flag would run
    every step for nothing, and when the optimization is given up. Returns how many went.
    """
    removed = 0
    for flag in density_flags(model):
        if attribute(flag, "func_name") != ENGINE_FLAG:
            continue
        scalars = list(attribute(flag, "input_int_scalars") or [])
        if keep_printing and len(scalars) > 1 and scalars[1]:
            continue
        source, result = flag.input[0], flag.output[1]
        for node in model.graph.node:
            for i, name in enumerate(node.input):
                if name == result:
                    node.input[i] = source
        model.graph.node.remove(flag)
        removed += 1
    return removed
