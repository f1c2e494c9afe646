"""What the sparsity options ask for (:class:`SparsityConfig`), read by the batch passes of
this package.

>>> SparsityConfig(padding=True).threshold
0.9
"""

from __future__ import annotations

from dataclasses import dataclass

from .label_density import DENSITY_THRESHOLD

__all__ = ["SparsityConfig"]


@dataclass(frozen=True)
class SparsityConfig:
    """What the options ask for: the optimization, the per-step density print, the threshold."""

    label: bool = True
    print_density: bool = False
    threshold: float = DENSITY_THRESHOLD
    #: padding elimination (``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER``)
    padding: bool = False
