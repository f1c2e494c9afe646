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
from ortmodule_exporter.engine import model_with_named_dims
from ortmodule_exporter.onnx_graph import FLOAT_TYPES

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


def _size_one_float_inputs(exported: ExportedModel) -> list[str]:
    """User inputs of a float type with a fixed dim of 1: each may require grad at a call, and
    the gradient build then refuses named dims (``GraphConfig.broadcast_grad_inputs``)."""
    users = set(exported.user_input_names)
    return [
        vi.name
        for vi in exported.model.graph.input
        if vi.name in users
        and vi.type.tensor_type.elem_type in FLOAT_TYPES
        and any(d.HasField("dim_value") and d.dim_value == 1 for d in vi.type.tensor_type.shape.dim)
    ]


def name_dims(exported: ExportedModel, options: Mapping[str, Any]) -> None:
    """Post-export pass: symbolic shape inference over a training graph, when it will be used,
    and only where the gradient build would name the dims too.

    The model this pass names is the one the engine builds, so it takes the build's own checks
    (``engine.model_with_named_dims``: no ATen node whose shapes inference would guess, no
    input's dims changed) and leaves a graph alone when an input of size 1 may require grad.
    Naming the dims here regardless undid those checks at ``ORTMODULE_LOG_LEVEL=INFO`` and at
    every recompute level: ``gelu(tanh(x)).expand(-1, 2)`` of a ``(2, 1)`` input that requires
    grad failed in the backward (fuzz finding, ``test_fuzz_findings.py``) only then."""
    if not exported.training or not wants_named_dims(options):
        return
    why = ""
    size_one = _size_one_float_inputs(exported)
    if size_one:
        why = f"inputs with a dim of size 1 may require grad ({', '.join(size_one)})"
    else:
        named = model_with_named_dims(exported.model)
        if named is None:
            why = "the gradient build would not name them (see the INFO line above)"
        else:
            exported.model = named
    if why:
        logger.info(
            "memory optimizer: the graph's dims stay unnamed: %s; recompute savings whose dims "
            "are unnamed are shown as unknown",
            why,
        )
