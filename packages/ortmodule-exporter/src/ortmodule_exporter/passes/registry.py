"""Post-export graph passes: edits of the exported ONNX model made before the gradient build.

Other packages add passes here (memory-efficient gradients, density flags, ZeRO-3) instead of
the runtime importing their internals.

Example::

    from ortmodule_exporter import register_post_export_pass

    def tag_graph(exported, options):
        exported.model.doc_string = "tagged"

    register_post_export_pass("tag", tag_graph, order=50)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..export.model import ExportedModel
from ..ordered import OrderedRegistry, Registered

PassFn = Callable[[ExportedModel, Mapping[str, Any]], None]
PostExportPass = Registered[PassFn]

_PASSES: OrderedRegistry[PassFn] = OrderedRegistry()


def register_post_export_pass(name: str, fn: PassFn, order: int = 100) -> None:
    """Run ``fn(exported, options)`` after every export; lower ``order`` runs first."""
    _PASSES.register(name, fn, order)


def unregister_post_export_pass(name: str) -> None:
    _PASSES.unregister(name)


def run_post_export_passes(
    exported: ExportedModel, options: Mapping[str, Any] | None = None
) -> list[str]:
    """Apply every registered pass in order; returns the names that ran."""
    passes = _PASSES.in_order()
    for p in passes:
        p.fn(exported, options or {})
    return [p.name for p in passes]
