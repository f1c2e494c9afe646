"""The table of covered operators: each family registers a :class:`CoveredOperator` (its
symbolic, and the symbolic to fall back to where the engine's kernel stays). An export whose
configuration's ``kernel_choice`` is ``auto`` or ``torch`` has them all on its symbolic table
(the ``kernel_choice`` layer, above the ATen routes); ``engine`` has none.

>>> from ortmodule_exporter.aten.kernel_choice import configure_kernel_choice, covered_operators
>>> configure_kernel_choice("engine")
>>> covered_operators()[0]
'aten::gelu'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...symbolics.registry import (
    LayerSymbolic,
    over_below,
    register_symbolic_layer,
    torch_symbolic,
)
from .modes import _set_mode


@dataclass(frozen=True)
class CoveredOperator:
    """An operator the kernel choice covers: ``symbolic(default, g, *args)`` replaces the
    exporter's symbolic for ``op`` and calls ``default(g, *args)`` (the symbolic it replaced,
    or ``fallback()`` when there was none) where the engine's kernel stays."""

    op: str
    symbolic: Callable[..., Any]
    fallback: Callable[[], Callable[..., Any]]
    opset: int = 9


_COVERED: dict[str, CoveredOperator] = {}


def register_kernel_choice(entry: CoveredOperator) -> None:
    """Cover ``entry.op`` in every later export whose kernel choice is ``auto`` or ``torch``.

    >>> register_kernel_choice(CoveredOperator("aten::relu", _relu_symbolic, _opset9("relu")))
    """
    _COVERED[entry.op] = entry
    # registered again: the symbolic tables cached without this operator are dropped
    register_symbolic_layer("kernel_choice", _kernel_choice_layer, order=30)


def covered_operators() -> tuple[str, ...]:
    """The symbolics the kernel choice replaces (``aten::gelu``, ...)."""
    return tuple(_COVERED)


def _kernel_choice_layer(config: Any) -> Iterator[LayerSymbolic]:
    if config.kernel_choice == "engine":
        return
    for op, entry in _COVERED.items():
        yield LayerSymbolic(op, over_below(entry.symbolic, entry.fallback), entry.opset)


def _opset9(name: str) -> Callable[[], Callable[..., Any]]:
    return torch_symbolic(9, name)


def configure_kernel_choice(mode: str = "auto", torch_threads: int | None = None) -> None:
    """Set the process defaults: the mode (``auto``, ``torch``, ``engine``) and ``torch_threads``,
    PyTorch's intra-op threads while the engine runs PyTorch-run nodes
    (``ORTMODULE_TORCH_THREADS_IN_ENGINE``; 0 keeps PyTorch's count), which the measurement of
    the PyTorch side uses; None leaves it as it is. An export given an ``ExportConfig`` (as
    ORTModule's are) uses the config's ``kernel_choice`` and ``kernel_choice_threads``."""
    _set_mode(mode, torch_threads)


def _no_previous(name: str) -> Callable[[], Callable[..., Any]]:
    def fallback() -> Callable[..., Any]:
        raise RuntimeError(f"kernel choice: no symbolic to fall back to for {name}")

    return fallback
