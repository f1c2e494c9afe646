"""Labelled rows as a decision on the exporting batch: :func:`apply_label_rows` runs the rewrite
of :func:`~ortmodule_exporter.sparsity.padding.keep_labelled_rows` when a loss's labels are
sparse enough, and logs what it decided.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import onnx
import torch

from ..export.model import ExportedModel
from .config import SparsityConfig
from .density import LabelSite, label_sites, site_labels
from .label_density import label_density
from .padding import PaddingDecision, keep_labelled_rows

__all__ = ["apply_label_rows"]

logger = logging.getLogger("ortmodule.sparsity")


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
