"""PythonOp: ``torch.autograd.Function`` calls exported as one node the engine calls back into.

=====================  ==========================================================================
``registry``           the Functions this process exported (:data:`REGISTRY`), Function exporters
                       of other packages, :func:`python_op_node` for graph passes
``symbolic``           the switches (:func:`enable_custom_autograd`) and the export symbolic
``shape_inference``    :func:`register_shape_inference`: real output dims for a Function
``checks``             :func:`check_model`: refuse a model naming a Function not exported here
``runner``             the engine's forward and backward callbacks that run the Function
=====================  ==========================================================================

The post-export passes that call ``checks`` and ``shape_inference`` live in
:mod:`ortmodule_exporter.passes.python_op`.

>>> from ortmodule_exporter.python_op import enable_custom_autograd, register_shape_inference
>>> enable_custom_autograd(True)                       # what ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1 does
>>> register_shape_inference("my_pkg.ops.Gelu", lambda shapes, dtypes: [shapes[0]])
"""

from .checks import check_model, model_is_runnable
from .registry import (
    PYTHON_OP_DOMAIN,
    REGISTRY,
    FunctionEntry,
    FunctionRegistry,
    RefusedPythonOpError,
    python_op_exporters,
    python_op_node,
    qualified_name,
    register_python_op_exporter,
)
from .shape_inference import ShapeFn, register_shape_inference, unregister_shape_inference
from .symbolic import (
    CHECKPOINT_FUNCTIONS,
    CheckpointExportError,
    allow_autograd_checkpoint,
    custom_autograd_enabled,
    enable_custom_autograd,
    exporting_copy_of,
)

__all__ = [
    "CHECKPOINT_FUNCTIONS",
    "PYTHON_OP_DOMAIN",
    "REGISTRY",
    "CheckpointExportError",
    "FunctionEntry",
    "FunctionRegistry",
    "RefusedPythonOpError",
    "ShapeFn",
    "allow_autograd_checkpoint",
    "check_model",
    "custom_autograd_enabled",
    "enable_custom_autograd",
    "exporting_copy_of",
    "model_is_runnable",
    "python_op_exporters",
    "python_op_node",
    "qualified_name",
    "register_python_op_exporter",
    "register_shape_inference",
    "unregister_shape_inference",
]
