"""Label sparsity: on the first batch of a graph, flag losses whose labels are mostly ignored.

``ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER`` (with the compute optimizer and
``ORTMODULE_ENABLE_SPARSE_OPTIMIZER`` on) lets the engine compute a cross-entropy loss, and the
layers feeding it, on the labelled rows only. The decision is made once per exported graph from
the batch that caused the export: below :data:`DENSITY_THRESHOLD` of labels counted, the flag is
inserted; later batches run the shrunken graph whatever their density, which is exact (only
the ``ignore_index`` rows are dropped, and those contribute nothing to the loss).

``ORTMODULE_PRINT_INPUT_DENSITY=1`` logs the label density of every step, with or without the
optimization, and the density of every embedding lookup with a ``padding_idx`` (the share of
tokens that are not padding).

``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER=1`` (with the compute optimizer and
``ORTMODULE_ENABLE_SPARSE_OPTIMIZER`` on) runs the token-wise layers of a training graph on the
tokens the attention mask keeps (:func:`apply_padding_elimination`, built in
``ortmodule_exporter.passes.padding``, which proves on the exporting batch that the left-out rows
are never read). Like label sparsity it is decided once per exported graph.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import onnx
import torch

from ortmodule_exporter import ExportedModel
from ortmodule_exporter.passes.density import (
    DENSITY_THRESHOLD,
    LabelSite,
    embedding_sites,
    infer_symbolic_shapes,
    insert_density_flag,
    insert_embedding_density_print,
    label_density,
    label_sites,
    site_labels,
    strip_density_flags,
    tensor_value,
)
from ortmodule_exporter.passes.padding import (
    PaddingDecision,
    eliminate_padding,
    keep_labelled_rows,
)

logger = logging.getLogger("ortmodule")

__all__ = [
    "DENSITY_THRESHOLD",
    "LabelDecision",
    "PaddingDecision",
    "SparsityConfig",
    "apply_label_rows",
    "apply_label_sparsity",
    "apply_padding_elimination",
]


@dataclass(frozen=True)
class SparsityConfig:
    """What the options ask for: the optimization, the per-step density print, the threshold."""

    label: bool = True
    print_density: bool = False
    threshold: float = DENSITY_THRESHOLD
    #: padding elimination (``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER``)
    padding: bool = False


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


def apply_padding_elimination(
    exported: ExportedModel,
    feeds: Mapping[str, torch.Tensor],
    config: SparsityConfig,
    training: bool,
) -> PaddingDecision | None:
    """Run the token-wise layers of ``exported.model`` on the kept tokens only (in place).

    ``feeds`` maps graph input names to this batch's tensors, parameters included. Only training
    (gradient) graphs; ``None`` when the option is off. The decision is logged at INFO.
    """
    if not (config.padding and training):
        return None
    decision = eliminate_padding(
        exported.model, feeds, frozenset(exported.user_input_names), config.threshold
    )
    shown = "" if decision.density is None else f", {decision.density:.1%} of tokens kept"
    logger.info(
        "padding elimination %s%s: %s%s",
        "on" if decision.applied else "off",
        f" (mask {decision.mask_input})" if decision.mask_input else "",
        decision.reason,
        shown,
    )
    return decision


def _sparse(
    model: onnx.ModelProto, site: LabelSite, feeds: Mapping[str, torch.Tensor], threshold: float
) -> bool:
    labels = site_labels(model, site, feeds)
    return labels is not None and label_density(labels, site.ignore_index) < threshold


def apply_label_rows(
    exported: ExportedModel,
    feeds: Mapping[str, torch.Tensor],
    config: SparsityConfig,
    training: bool,
) -> PaddingDecision | None:
    """Run the token-wise layers that only a cross-entropy loss reads (a masked LM's head, and
    the last layer's feed-forward block) on the labelled tokens (in place).

    Part of label sparsity: the engine's own shrinking starts at the loss and stops at the
    first ``Reshape`` that merges batch and sequence, so it shrinks the vocabulary projection
    only. ``feeds`` maps graph input names to this batch's tensors, parameters included. Only
    training graphs; ``None`` when label sparsity is off. The decision is logged at INFO.
    """
    if not (config.label and training):
        return None
    model = exported.model
    devices = {t.device.type for t in feeds.values() if isinstance(t, torch.Tensor)}
    if devices != {"cpu"}:
        # the checks run the forward graph on the CPU: a whole extra forward of a GPU model
        decision = PaddingDecision(False, f"the batch and parameters are on {sorted(devices)}")
    elif not any(_sparse(model, site, feeds, config.threshold) for site in label_sites(model)):
        decision = PaddingDecision(False, f"no loss has under {config.threshold:.0%} labels")
    else:
        decision = keep_labelled_rows(model, feeds, config.threshold)
    shown = "" if decision.density is None else f", {decision.density:.1%} of tokens labelled"
    logger.info(
        "labelled rows %s: %s%s%s",
        "on" if decision.applied else "off",
        decision.reason,
        f" ({decision.token_wise_nodes} nodes)" if decision.applied else "",
        shown,
    )
    return decision
