"""The export itself: ``torch.nn.Module`` + inputs -> an ONNX graph the engine can differentiate.

===============  ================================================================================
``exporter``     :func:`export`: the TorchScript export, flattening, names, cache lookups
``model``        :class:`ExportedModel` (what an export produces), :class:`SaveOptions`
``config``       :class:`ExportConfig`: every setting that changes what an export writes
``cache``        :class:`ExportCache` (``ORTMODULE_CACHE_DIR``)
``transitions``  :class:`GraphTransitionManager`: one state machine deciding re-export
``guards``       :class:`Guard`: tensor -> Python conversions the trace baked in, checked each run
===============  ================================================================================

>>> import torch
>>> from ortmodule_exporter.export import export
>>> export(torch.nn.Linear(4, 2), (torch.randn(3, 4),), training=True).param_names
('weight', 'bias')
"""

from .cache import ExportCache
from .calls import bind_arguments, call_bound, forward_signature
from .config import DEFAULT_OPSET, ExportConfig
from .exporter import (
    MAX_OPSET,
    MIN_OPSET,
    check_opset,
    copy_for_export,
    export,
    module_path,
    traced_in_place,
)
from .guards import Guard, GuardError
from .model import SAVED_STAGES, ExportedModel, ExtraInput, SaveOptions
from .transitions import (
    GraphKey,
    GraphTransitionManager,
    describe_change,
    parameter_signature,
    trace_state,
)

__all__ = [
    "DEFAULT_OPSET",
    "MAX_OPSET",
    "MIN_OPSET",
    "SAVED_STAGES",
    "ExportCache",
    "ExportConfig",
    "ExportedModel",
    "ExtraInput",
    "GraphKey",
    "Guard",
    "GuardError",
    "GraphTransitionManager",
    "SaveOptions",
    "bind_arguments",
    "call_bound",
    "check_opset",
    "copy_for_export",
    "describe_change",
    "export",
    "forward_signature",
    "module_path",
    "parameter_signature",
    "trace_state",
    "traced_in_place",
]
