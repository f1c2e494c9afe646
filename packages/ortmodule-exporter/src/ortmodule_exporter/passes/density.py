"""Moved to :mod:`ortmodule_exporter.sparsity.density` (symbolic shape inference to
:mod:`ortmodule_exporter.named_dims`); this name stays for other packages' and the tests' imports
(patch the functions there, not here)."""

from ..named_dims import infer_symbolic_shapes
from ..sparsity.density import (
    DENSITY_THRESHOLD,
    ENGINE_FLAG,
    PRINT_ONLY,
    DensityFlag,
    EmbeddingSite,
    LabelSite,
    density_flags,
    embedding_sites,
    insert_density_flag,
    insert_embedding_density_print,
    label_density,
    label_sites,
    site_labels,
    strip_density_flags,
    tensor_value,
)

__all__ = [
    "DENSITY_THRESHOLD",
    "ENGINE_FLAG",
    "PRINT_ONLY",
    "DensityFlag",
    "EmbeddingSite",
    "LabelSite",
    "density_flags",
    "embedding_sites",
    "infer_symbolic_shapes",
    "insert_density_flag",
    "insert_embedding_density_print",
    "label_density",
    "label_sites",
    "site_labels",
    "strip_density_flags",
    "tensor_value",
]
