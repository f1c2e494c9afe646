"""The one module that imports PyTorch's TorchScript ONNX exporter (``torch.onnx``'s private
``_internal.torchscript_exporter`` package), which the ``torchscript`` frontend, our symbolics
and the ATen routes build on.

PyTorch has announced that this exporter will be removed, and its modules are private: when a
torch release moves or drops one, this file is the one to change. Everything else imports the
names below from here.

>>> from ortmodule_exporter.torchscript_onnx import symbolic_helper, symbolic_opset
>>> symbolic_opset(9).relu is not None
True
"""

from __future__ import annotations

from types import ModuleType

from torch.onnx._internal.torchscript_exporter import (
    _type_utils as type_utils,
)
from torch.onnx._internal.torchscript_exporter import (
    jit_utils,
    symbolic_helper,
    symbolic_opset9,
    symbolic_opset11,
    symbolic_opset12,
    symbolic_opset13,
    symbolic_opset14,
)
from torch.onnx._internal.torchscript_exporter import (
    utils as export_utils,
)
from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

__all__ = [
    "GLOBALS",
    "export_utils",
    "jit_utils",
    "symbolic_helper",
    "symbolic_opset",
    "symbolic_opset9",
    "symbolic_opset11",
    "symbolic_opset12",
    "symbolic_opset13",
    "symbolic_opset14",
    "type_utils",
]

_OPSETS: dict[int, ModuleType] = {
    9: symbolic_opset9,
    11: symbolic_opset11,
    12: symbolic_opset12,
    13: symbolic_opset13,
    14: symbolic_opset14,
}


def symbolic_opset(opset: int) -> ModuleType:
    """PyTorch's symbolics module of ``opset`` (one of 9, 11, 12, 13, 14)."""
    try:
        return _OPSETS[opset]
    except KeyError:
        raise ValueError(
            f"symbolic_opset({opset}): only opsets {sorted(_OPSETS)} are imported; "
            "add the module to ortmodule_exporter.torchscript_onnx"
        ) from None
