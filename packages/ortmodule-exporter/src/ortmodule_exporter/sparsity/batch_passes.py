"""The sparsity decisions as batch passes (:mod:`ortmodule_exporter.passes.batch`), in order:

=========================  ==== =================================================================
``padding_elimination``    10   :func:`~.padding_elimination.apply_padding_elimination`
``labelled_rows``          20   :func:`~.labelled_rows.apply_label_rows`, only where padding
                                elimination was not applied, under the export's switches (the
                                loss on the labelled rows takes their kernel choice)
``label_sparsity``         30   :func:`~.label_sparsity.apply_label_sparsity` on the user's
                                inputs alone, told what labelled rows did
=========================  ==== =================================================================

Importing this module registers them (``ortmodule_exporter`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from ..export.model import ExportedModel
from ..passes.batch import BatchContext, register_batch_pass
from .label_sparsity import LabelDecision, apply_label_sparsity
from .labelled_rows import apply_label_rows
from .padding import PaddingDecision
from .padding_elimination import apply_padding_elimination

__all__ = ["LABELLED_ROWS", "LABEL_SPARSITY", "PADDING_ELIMINATION"]

PADDING_ELIMINATION = "padding_elimination"
LABELLED_ROWS = "labelled_rows"
LABEL_SPARSITY = "label_sparsity"


def _padding_elimination(
    exported: ExportedModel, batch: Mapping[str, torch.Tensor], context: BatchContext
) -> PaddingDecision | None:
    return apply_padding_elimination(exported, batch, context.sparsity, context.training)


def _labelled_rows(
    exported: ExportedModel, batch: Mapping[str, torch.Tensor], context: BatchContext
) -> PaddingDecision | None:
    padded = context.results.get(PADDING_ELIMINATION)
    if padded is not None and padded.applied:
        return None
    # under the export's switches: the loss on the labelled rows takes their kernel choice
    config = context.export_config
    with config.applied() if config is not None else contextlib.nullcontext():
        return apply_label_rows(exported, batch, context.sparsity, context.training)


def _label_sparsity(
    exported: ExportedModel, batch: Mapping[str, torch.Tensor], context: BatchContext
) -> list[LabelDecision]:
    # the user's inputs alone: labels computed from a parameter or buffer are not this batch's
    inputs = {name: batch[name] for name in exported.input_schema.names}
    return apply_label_sparsity(
        exported,
        inputs,
        context.sparsity,
        context.training,
        rows=context.results.get(LABELLED_ROWS),
    )


register_batch_pass(PADDING_ELIMINATION, _padding_elimination, order=10)
register_batch_pass(LABELLED_ROWS, _labelled_rows, order=20)
register_batch_pass(LABEL_SPARSITY, _label_sparsity, order=30)
