"""The decision itself: ``engine`` or ``torch`` per (operator, dtype, size class), measured once
per process under ``auto`` and kept (:func:`decisions`), or forced by the mode.

A family's symbolic asks :func:`choose` (a size in elements) or ``_decide`` (its own size key)
with a measurement that returns (engine us, PyTorch us); the faster route wins.

>>> from ortmodule_exporter.aten.kernel_choice import choose, configure_kernel_choice
>>> configure_kernel_choice("torch")
>>> choose("gelu(none)", "Float", 1024, lambda n: (1.0, 2.0))
'torch'
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .modes import LOSSES, current_mode, current_torch_threads
from .traced import _recording_off_cpu

logger = logging.getLogger("ortmodule.exporter")


#: elements of the tensor the calibration times when the export does not know the size
CALIBRATION_NUMEL = 1 << 20


_LOCK = threading.Lock()
#: (operator, dtype, size class) -> "engine" or "torch", with the timings that decided it
_DECISIONS: dict[tuple[str, str, Any], tuple[str, float, float]] = {}
#: (operator, dtype, size class) -> seconds its measurement took in this process
_SECONDS: dict[tuple[str, str, Any], float] = {}


def decisions() -> dict[tuple[str, str, Any], tuple[str, float, float]]:
    """What was chosen so far: key -> (route, engine us, torch us incl. the ATen nodes)."""
    with _LOCK:
        return dict(_DECISIONS)


def calibration_seconds() -> dict[tuple[str, str, Any], float]:
    """Seconds each decision's measurement took in this process (keys of :func:`decisions`;
    a decision this process did not measure itself is absent)."""
    with _LOCK:
        return dict(_SECONDS)


def _take_decisions(found: dict[tuple[str, str, Any], tuple[str, float, float]]) -> int:
    """Keep the decisions of ``found`` this process has not made itself; how many were new."""
    with _LOCK:
        new = {k: v for k, v in found.items() if k not in _DECISIONS}
        _DECISIONS.update(new)
    return len(new)


def _size_class(numel: int) -> int:
    return 1 << max(0, round(math.log2(max(numel, 1))))


def _decide(
    op: str,
    dtype: str,
    size: Any,
    measure: Callable[[], tuple[float, float]],
    *,
    loss: bool = False,
    backward_only: bool = False,
) -> str:
    """The route of ``op`` under the mode in force; ``loss``: ``op`` is a loss,
    ``backward_only``: a node of the built gradient graph's backward (both measured under
    ``losses`` too)."""
    mode = current_mode()
    if mode == LOSSES:
        mode = "auto" if loss or backward_only else "engine"
    if mode != "auto":
        return mode
    if _recording_off_cpu():
        # the measurements time CPU kernels; on CUDA the engine's stay until they time CUDA
        return "engine"
    key = (op, dtype, size)
    with _LOCK:
        found = _DECISIONS.get(key)
    if found is None:
        start = time.perf_counter()
        try:
            engine_us, torch_us = measure()
        except Exception as err:  # noqa: BLE001 - no measurement: keep the engine's kernel
            logger.info("kernel choice: could not time %s (%s); using the engine's kernel", op, err)
            engine_us, torch_us = 0.0, math.inf
        route = "torch" if torch_us < engine_us else "engine"
        found = (route, engine_us, torch_us)
        with _LOCK:
            _DECISIONS[key] = found
            _SECONDS[key] = time.perf_counter() - start
        logger.info(
            "kernel choice: %s %s on %s runs on %s (engine %.0f us, PyTorch %.0f us "
            "with its ATen nodes, %d PyTorch threads)",
            op,
            dtype,
            size,
            route,
            engine_us,
            torch_us,
            current_torch_threads() or torch.get_num_threads(),
        )
    return found[0]


def choose(
    op: str,
    dtype: str,
    numel: int | None,
    measure: Callable[[int], tuple[float, float]],
    *,
    backward_only: bool = False,
) -> str:
    """``"engine"`` or ``"torch"`` for ``op`` on tensors of ``numel`` elements (None: unknown);
    ``backward_only`` as in :func:`_decide`."""
    size = _size_class(numel if numel is not None else CALIBRATION_NUMEL)
    return _decide(op, dtype, size, lambda: measure(size), backward_only=backward_only)
