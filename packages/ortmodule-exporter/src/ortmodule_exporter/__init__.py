"""torch.nn.Module -> ONNX training graph that ONNX Runtime's training engine can differentiate.

>>> import torch
>>> from ortmodule_exporter import export
>>> exported = export(torch.nn.Linear(4, 2), (torch.randn(3, 4),), training=True)
>>> exported.param_names
('weight', 'bias')
"""

from . import (
    empty_tensors,
    engine_graph_fixes,  # noqa: F401 - registers its post-export pass
    gradient_gaps,
    output_ranks,  # noqa: F401 - registers its post-export pass
)
from .built_graph_passes import register_built_graph_pass, unregister_built_graph_pass
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
    ExportedModel,
    SaveOptions,
    check_opset,
    export,
)
from .export_cache import ExportCache
from .export_config import ExportConfig
from .graph_transition import GraphKey, GraphTransitionManager, describe_change, parameter_signature
from .mask_symbolics import register_mask_symbolics
from .post_export import (
    register_post_export_pass,
    run_post_export_passes,
    unregister_post_export_pass,
)
from .symbolic_registry import register_symbolic, registered_symbolics, unregister_symbolic
from .symbolics import register_builtin_symbolics

register_builtin_symbolics()
register_mask_symbolics()
empty_tensors.install()
gradient_gaps.install()

__version__ = "0.1.0"

__all__ = [
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
    "InvalidOptionError",
    "ORTModuleError",
    "SaveOptions",
    "UnsupportedOutputError",
    "check_opset",
    "describe_change",
    "export",
    "parameter_signature",
    "register_built_graph_pass",
    "register_post_export_pass",
    "register_symbolic",
    "registered_symbolics",
    "unregister_built_graph_pass",
    "run_post_export_passes",
    "unregister_post_export_pass",
    "unregister_symbolic",
]
