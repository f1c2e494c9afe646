"""Label sparsity: on the first batch of a graph, flag losses whose labels are mostly ignored.

:func:`apply_label_sparsity` finds each ``SoftmaxCrossEntropyLoss`` the engine can shrink
(:mod:`ortmodule_exporter.sparsity.density`), computes its labels on the batch that caused the
export and, below the threshold of counted labels, inserts the engine's density flag before the
loss (or a print-only flag for ``ORTMODULE_PRINT_INPUT_DENSITY``); a failure leaves the graph as
exported and logs a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import onnx
import torch

from ..export.model import ExportedModel
from ..named_dims import infer_symbolic_shapes
from .config import SparsityConfig
from .density import (
    embedding_sites,
    insert_density_flag,
    insert_embedding_density_print,
    label_sites,
    site_labels,
    strip_density_flags,
    tensor_value,
)
from .label_density import label_density
from .padding import PaddingDecision

__all__ = ["LabelDecision", "apply_label_sparsity"]

logger = logging.getLogger("ortmodule.sparsity")


@dataclass(frozen=True)
class LabelDecision:
    """What was decided for one loss node, for the INFO log and for tests."""

    node: str
    labels: str
    density: float | None
    applied: bool
    reason: str


def apply_label_sparsity(
    exported: ExportedModel,
    feeds: Mapping[str, torch.Tensor],
    config: SparsityConfig,
    training: bool,
    rows: PaddingDecision | None = None,
) -> list[LabelDecision]:
    """Insert the density flags ``config`` asks for into ``exported.model`` (in place).

    ``feeds`` maps graph input names to this batch's tensors. The engine optimization is only
    requested in a ``training`` (gradient) graph, where the engine's compute optimizer runs.
    ``rows``: what :func:`apply_label_rows` did; its losses already read the labelled rows, so
    the engine is not asked again (a density print reads the labels before the gather).
    """
    if not (config.label or config.print_density):
        return []
    original = onnx.ModelProto()
    original.CopyFrom(exported.model)
    shrunk = frozenset(rows.losses) if rows is not None and rows.applied else frozenset()
    try:
        return _apply(exported, feeds, config, training, shrunk)
    except Exception as err:  # noqa: BLE001 - an optional optimization never stops training
        exported.model = original
        logger.warning(
            "label sparsity skipped (the graph is used as exported): %s: %s",
            type(err).__name__,
            err,
        )
        return []


def _why_not(
    labels: np.ndarray, density: float, config: SparsityConfig, training: bool
) -> str | None:
    """Why the engine is not asked to shrink a loss reading ``labels``; ``None`` when it is."""
    if labels.dtype != np.int64:
        return f"its labels are {labels.dtype}, not int64"
    if not config.label:
        return "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER is off"
    if not training:
        return "not a training graph"
    if labels.ndim != 1:
        return f"its labels have rank {labels.ndim} (the engine shrinks rank 1)"
    if density >= config.threshold:
        return f"density is not below {config.threshold:.0%}"
    return None


def _apply(
    exported: ExportedModel,
    feeds: Mapping[str, torch.Tensor],
    config: SparsityConfig,
    training: bool,
    shrunk: frozenset[str] = frozenset(),
) -> list[LabelDecision]:
    model = exported.model
    decisions = []
    producer = {o: n for n in model.graph.node for o in n.output}
    for site in label_sites(model):
        if site.node in shrunk:
            # the labelled-rows gather of the labels: flag (print) what it reads
            site = replace(site, labels=producer[site.labels].input[0])
            labels = site_labels(model, site, feeds)
            density = None if labels is None else label_density(labels, site.ignore_index)
            if config.print_density and labels is not None and labels.dtype == np.int64:
                insert_density_flag(
                    model, site, engine=False, emit=True, rank=labels.ndim, every_reader=True
                )
            reason = "the loss and the layers only it reads run on the labelled rows already"
            decisions.append(LabelDecision(site.node, site.labels, density, True, reason))
            continue
        labels = site_labels(model, site, feeds)
        if labels is None:
            decisions.append(
                LabelDecision(
                    site.node,
                    site.labels,
                    None,
                    False,
                    "its labels are not computed from the inputs alone",
                )
            )
            continue
        density = label_density(labels, site.ignore_index)
        off = _why_not(labels, density, config, training)
        applied = off is None
        if applied or (config.print_density and labels.dtype == np.int64):
            insert_density_flag(
                model, site, engine=applied, emit=config.print_density, rank=labels.ndim
            )
        reason = off or "loss computed on the counted labels only"
        decisions.append(LabelDecision(site.node, site.labels, density, applied, reason))

    if config.print_density:
        for embedding in embedding_sites(model, frozenset(exported.param_names)):
            indices = tensor_value(model, embedding.indices, feeds)
            if indices is not None and indices.dtype == np.int64:
                insert_embedding_density_print(model, embedding, rank=indices.ndim)

    if any(d.applied and d.node not in shrunk for d in decisions):
        # Without the build's refusals (engine.model_with_named_dims): a PythonOp's output dims
        # are made up, and merged with a dim they meet in a broadcast. A norm over the sequence,
        # (batch, 1, d) divided into (batch, seq, d), is named (batch, seq, d): wrong, yet its
        # gradients equal eager's with label sparsity on (a norm over each of the three dims,
        # 2026-11-29, test_label_sparsity.py); refusing such merges turned label sparsity off.
        try:
            exported.model = infer_symbolic_shapes(model)
        except Exception as err:  # noqa: BLE001 - the optimization is optional
            strip_density_flags(model, keep_printing=False)
            decisions = [
                LabelDecision(d.node, d.labels, d.density, False, f"shape inference failed: {err}")
                if d.applied and d.node not in shrunk
                else d
                for d in decisions
            ]
    for d in decisions:
        shown = "unknown" if d.density is None else f"{d.density:.1%}"
        logger.info(
            "label sparsity %s for loss %s (labels %s, density %s): %s",
            "on" if d.applied else "off",
            d.node,
            d.labels,
            shown,
            d.reason,
        )
    return decisions
