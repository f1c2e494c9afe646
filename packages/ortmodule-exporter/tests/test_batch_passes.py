"""Batch passes run in order on the exporting batch, and each sees what the earlier ones returned."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ortmodule_exporter import (
    BatchContext,
    ExportedModel,
    export,
    register_batch_pass,
    run_batch_passes,
    unregister_batch_pass,
)
from ortmodule_exporter.sparsity import batch_passes
from ortmodule_exporter.sparsity.config import SparsityConfig
from ortmodule_exporter.sparsity.padding import PaddingDecision


def _exported() -> tuple[ExportedModel, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    exported = export(linear, (x,), training=True)
    batch = {**dict(linear.named_parameters()), exported.user_input_names[0]: x}
    return exported, batch


def test_the_sparsity_passes_run_in_order_and_hand_on_their_results() -> None:
    exported, batch = _exported()
    seen: list[tuple[list[str], list[str]]] = []

    def record(_e: ExportedModel, b: Mapping[str, torch.Tensor], c: BatchContext) -> Any:
        seen.append((sorted(c.results), sorted(b)))
        return "recorded"

    register_batch_pass("record", record, order=25)
    try:
        context = BatchContext(training=True, sparsity=SparsityConfig())
        results = run_batch_passes(exported, batch, context)
    finally:
        unregister_batch_pass("record")
    # between labelled rows (20) and label sparsity (30), parameters in the batch
    assert seen == [
        (
            [batch_passes.LABELLED_ROWS, batch_passes.PADDING_ELIMINATION],
            sorted(batch),
        )
    ]
    assert results is context.results
    assert results["record"] == "recorded"
    assert results[batch_passes.PADDING_ELIMINATION] is None  # the option is off
    labelled = results[batch_passes.LABELLED_ROWS]
    assert isinstance(labelled, PaddingDecision) and not labelled.applied
    assert results[batch_passes.LABEL_SPARSITY] == []  # no loss


def test_labelled_rows_only_where_padding_elimination_was_not_applied() -> None:
    exported, batch = _exported()
    context = BatchContext(training=True, sparsity=SparsityConfig())
    context.results[batch_passes.PADDING_ELIMINATION] = PaddingDecision(True, "kept tokens")
    assert batch_passes._labelled_rows(exported, batch, context) is None
    context.results[batch_passes.PADDING_ELIMINATION] = PaddingDecision(False, "no mask")
    decision = batch_passes._labelled_rows(exported, batch, context)
    assert isinstance(decision, PaddingDecision) and not decision.applied


def test_eval_graphs_are_left_alone() -> None:
    exported, batch = _exported()
    before = exported.model.SerializeToString()
    context = BatchContext(training=False, sparsity=SparsityConfig(padding=True))
    results = run_batch_passes(exported, batch, context)
    assert results[batch_passes.PADDING_ELIMINATION] is None
    assert results[batch_passes.LABELLED_ROWS] is None
    assert exported.model.SerializeToString() == before
