"""When label sparsity applies: the share of labels that count, and the threshold below which the
engine computes a cross-entropy on the labelled rows only.

Both the label-sparsity pass (:mod:`ortmodule_exporter.sparsity.label_sparsity`) and the kernel choice
(which leaves such a loss on the engine's kernel) decide with these, on the same first batch.

>>> label_density(np.array([3, -100, 5, -100]), ignore_index=-100)
0.5
"""

from __future__ import annotations

import numpy as np

__all__ = ["DENSITY_THRESHOLD", "label_density"]

#: below this fraction of counted labels the optimization is applied (above it the gather costs more
#: than the rows it saves)
DENSITY_THRESHOLD = 0.9


def label_density(labels: np.ndarray, ignore_index: int) -> float:
    """The fraction of ``labels`` that are not ``ignore_index`` (1.0 for no labels)."""
    if labels.size == 0:
        return 1.0
    return float(np.count_nonzero(labels != ignore_index)) / float(labels.size)
