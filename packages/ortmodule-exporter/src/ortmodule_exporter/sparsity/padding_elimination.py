"""Padding elimination as a decision on the exporting batch: :func:`apply_padding_elimination`
runs the rewrite of :func:`~ortmodule_exporter.sparsity.padding.eliminate_padding` when the
options ask for it, and logs what it decided.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from ..export.model import ExportedModel
from .config import SparsityConfig
from .padding import PaddingDecision, eliminate_padding

__all__ = ["apply_padding_elimination"]

logger = logging.getLogger("ortmodule.sparsity")


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
