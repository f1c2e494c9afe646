"""torch.nn.Module -> ONNX training graph that ONNX Runtime's training engine can differentiate.

>>> import torch
>>> from ortmodule_exporter import export
>>> exported = export(torch.nn.Linear(4, 2), (torch.randn(3, 4),), training=True)
>>> exported.param_names
('weight', 'bias')
"""

from . import passes  # noqa: F401 - registers the built-in post-export passes
from .aten import empty_tensors, gradient_gaps, low_precision, uneven_split
from .errors import (
    EngineBuildError,
    ExportError,
    InvalidOptionError,
    ORTModuleError,
    UnsupportedOutputError,
)
from .export import (
    DEFAULT_OPSET,
    MAX_OPSET,
    MIN_OPSET,
    ExportCache,
    ExportConfig,
    ExportedModel,
    GraphKey,
    GraphTransitionManager,
    Guard,
    GuardError,
    SaveOptions,
    check_opset,
    describe_change,
    export,
    parameter_signature,
    trace_state,
)
from .passes import register_post_export_pass, run_post_export_passes, unregister_post_export_pass
from .passes.batch import BatchContext, register_batch_pass, run_batch_passes, unregister_batch_pass
from .passes.built_graph import register_built_graph_pass, unregister_built_graph_pass
from .sparsity import batch_passes  # noqa: F401 - registers the sparsity batch passes
from .symbolics.builtin import register_builtin_symbolics
from .symbolics.mask import register_mask_symbolics
from .symbolics.registry import register_symbolic, registered_symbolics, unregister_symbolic

register_builtin_symbolics()
register_mask_symbolics()
empty_tensors.install()
gradient_gaps.install()
low_precision.install()
uneven_split.install()

__version__ = "0.1.0"

__all__ = [
    "BatchContext",
    "DEFAULT_OPSET",
    "MAX_OPSET",
    "MIN_OPSET",
    "EngineBuildError",
    "ExportCache",
    "ExportConfig",
    "ExportError",
    "ExportedModel",
    "GraphKey",
    "GraphTransitionManager",
    "Guard",
    "GuardError",
    "InvalidOptionError",
    "ORTModuleError",
    "SaveOptions",
    "UnsupportedOutputError",
    "check_opset",
    "describe_change",
    "export",
    "parameter_signature",
    "trace_state",
    "register_batch_pass",
    "register_built_graph_pass",
    "register_post_export_pass",
    "register_symbolic",
    "registered_symbolics",
    "unregister_batch_pass",
    "unregister_built_graph_pass",
    "run_batch_passes",
    "run_post_export_passes",
    "unregister_post_export_pass",
    "unregister_symbolic",
]
