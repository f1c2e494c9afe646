"""ONNX values for the nodes the ``torch_export`` frontend writes itself, in place of the
translator's lowering of an FX node (the ATen route, :mod:`.torch_export_aten`; the kernel
choice, :mod:`.torch_export_kernel_choice`): constants, the value of an FX argument, and the
written nodes attached to the FX node as the translator attaches its own.

>>> from ortmodule_exporter.export.torch_export_values import constant
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["added_for", "constant", "one_value"]


def constant(array: np.ndarray) -> tuple[Any, Any]:
    """A ``Constant`` node holding ``array`` and its typed output value."""
    from onnxscript import ir  # noqa: PLC0415 - optional frontend

    made = ir.Node("", "Constant", (), [ir.AttrTensor("value", ir.tensor(array))])
    out = made.outputs[0]
    out.dtype = ir.DataType.from_numpy(array.dtype)
    out.shape = ir.Shape(array.shape)
    return made, out


def one_value(core: Any, arg: Any, values: dict[str, Any], functions: dict[str, Any]) -> Any | None:
    """The ONNX value of the FX argument ``arg``, or None where it is not one value (a list,
    a Python number the translator keeps as such)."""
    value = core._convert_fx_arg_to_onnx_arg(arg, values, functions)
    if isinstance(value, Sequence) or not hasattr(value, "dtype"):
        return None
    return value


def added_for(core: Any, node: torch.fx.Node, made: Sequence[Any], graph_like: Any) -> None:
    """Add ``made`` (written in place of ``node``'s lowering) to ``graph_like``, each with the
    FX node's metadata, as the translator attaches it to the nodes of a lowering."""
    for n in made:
        n.meta["node"] = node
        core._set_node_metadata(node, n)
    graph_like.extend(made)
