"""Name every dim of the exported graph, so the engine's savings are expressions of the inputs.

The engine states each recompute saving as a product of the stashed tensor's dims. A dim that
shape inference left anonymous shows up as ``empty_dim_paramN`` and cannot be evaluated for a
batch; after symbolic shape inference every dim is a number or an expression of the graph
inputs' dynamic dims (``input.input_ids_dim0``), which the batch's shapes give values to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ortmodule_exporter import ExportedModel
from ortmodule_exporter.passes.density import infer_symbolic_shapes

from .recompute import CONFIG, LEVEL

__all__ = ["name_dims", "wants_named_dims"]

logger = logging.getLogger("ortmodule.memory")

_INFO = 2  # ortmodule's LogLevel.INFO


def wants_named_dims(options: Mapping[str, Any]) -> bool:
    """Recompute is asked for, or the opportunity table will be logged (INFO or lower)."""
    log_level = options.get("ORTMODULE_LOG_LEVEL")
    return bool(
        int(options.get(LEVEL) or 0) > 0
        or options.get(CONFIG)
        or (log_level is not None and int(log_level) <= _INFO)
    )


def name_dims(exported: ExportedModel, options: Mapping[str, Any]) -> None:
    """Post-export pass: symbolic shape inference over a training graph, when it will be used."""
    if not exported.training or not wants_named_dims(options):
        return
    try:
        exported.model = infer_symbolic_shapes(exported.model)
    except Exception as err:  # noqa: BLE001 - only the table's byte counts depend on it
        logger.info(
            "memory optimizer: symbolic shape inference failed (%s: %s); recompute savings "
            "whose dims stay unnamed are shown as unknown",
            type(err).__name__,
            err,
        )
