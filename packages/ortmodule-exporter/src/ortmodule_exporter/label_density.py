"""Moved to :mod:`ortmodule_exporter.sparsity.label_density`; this name stays for the kernel
choice's imports."""

from .sparsity.label_density import DENSITY_THRESHOLD, label_density

__all__ = ["DENSITY_THRESHOLD", "label_density"]
