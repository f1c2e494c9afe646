"""Moved to :mod:`ortmodule_exporter.sparsity`; this name stays for the tests' imports (patch
the functions there, not here)."""

from ortmodule_exporter.sparsity.config import SparsityConfig
from ortmodule_exporter.sparsity.label_density import DENSITY_THRESHOLD
from ortmodule_exporter.sparsity.label_sparsity import LabelDecision, apply_label_sparsity
from ortmodule_exporter.sparsity.labelled_rows import apply_label_rows
from ortmodule_exporter.sparsity.padding import PaddingDecision
from ortmodule_exporter.sparsity.padding_elimination import apply_padding_elimination

__all__ = [
    "DENSITY_THRESHOLD",
    "LabelDecision",
    "PaddingDecision",
    "SparsityConfig",
    "apply_label_rows",
    "apply_label_sparsity",
    "apply_padding_elimination",
]
