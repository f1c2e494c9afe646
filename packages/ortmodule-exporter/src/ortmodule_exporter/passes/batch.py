"""Batch passes: edits of the exported ONNX model that read the batch that caused the export,
made after the post-export passes and before the gradient build.

A post-export pass sees the graph alone; some decisions need values (how many labels a loss
counts, which tokens the attention mask keeps). A batch pass gets the
:class:`~ortmodule_exporter.export.model.ExportedModel`, the batch (graph input name -> tensor,
the module's parameters and buffers included) and a :class:`BatchContext`; it edits
``exported.model`` in place and returns what it decided (``None`` when it did nothing). Each
result is kept in ``context.results`` under the pass's name, so a later pass reads what an
earlier one did. The decision is made once per exported graph: later batches run the graph the
passes left.

>>> def tag(exported, batch, context):
...     exported.model.doc_string = "seen"
>>> register_batch_pass("tag", tag, order=50)
>>> unregister_batch_pass("tag")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..export.config import ExportConfig
from ..export.model import ExportedModel
from ..ordered import OrderedRegistry, Registered
from ..sparsity.config import SparsityConfig

__all__ = [
    "BatchContext",
    "BatchPass",
    "register_batch_pass",
    "run_batch_passes",
    "unregister_batch_pass",
]


@dataclass(frozen=True)
class BatchContext:
    """What a batch pass knows besides the graph and the batch."""

    #: a gradient (training) graph is built
    training: bool
    #: what the sparsity options ask for
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    #: the switches the export ran under (a pass that routes operators applies them); ``None``:
    #: the switches as they are
    export_config: ExportConfig | None = None
    #: what each pass that ran returned, by name (filled by :func:`run_batch_passes`)
    results: dict[str, Any] = field(default_factory=dict)


BatchPassFn = Callable[[ExportedModel, Mapping[str, torch.Tensor], BatchContext], Any]

BatchPass = Registered[BatchPassFn]

_PASSES: OrderedRegistry[BatchPassFn] = OrderedRegistry()


def register_batch_pass(name: str, fn: BatchPassFn, order: int = 100) -> None:
    """Run ``fn(exported, batch, context) -> result`` on every export; lower ``order`` first."""
    _PASSES.register(name, fn, order)


def unregister_batch_pass(name: str) -> None:
    _PASSES.unregister(name)


def run_batch_passes(
    exported: ExportedModel, batch: Mapping[str, torch.Tensor], context: BatchContext
) -> dict[str, Any]:
    """Apply every registered pass in order; returns ``context.results`` (what each returned)."""
    for p in _PASSES.in_order():
        context.results[p.name] = p.fn(exported, batch, context)
    return context.results
