"""The kernel choice on the ``torch_export`` frontend: where a covered operator's family chose
PyTorch's kernel for an FX node (:func:`~ortmodule_exporter.aten.kernel_choice.fx_kernel_choice`),
the node is written as the ATen node the family's TorchScript symbolic writes (same operator,
overload and inputs, so the same executor function and registered gradient run it), instead of
the translator's lowering. Called from the ATen route's per-node lowering
(:mod:`.torch_export_aten`).

>>> from ortmodule_exporter.export.torch_export_kernel_choice import write_kernel_choice
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import AtenChoice, fx_kernel_choice
from .torch_export_values import added_for, constant, one_value

__all__ = ["write_kernel_choice"]


def write_kernel_choice(
    core: Any,
    node: torch.fx.Node,
    values: dict[str, Any],
    local_functions: dict[str, Any],
    graph_like: Any,
    written: list[tuple[Any, int]],
) -> bool:
    """Write ``node`` as its family's ATen node into ``graph_like`` where the kernel choice
    chose PyTorch's kernel (and append it with its input count to ``written``); False (nothing
    written) where the translator's lowering stays."""
    choice = fx_kernel_choice(node)
    if choice is None:
        return False
    try:
        _Writer(core, node, values, local_functions).write(choice, graph_like, written)
    except _NotOneValue:
        return False  # nothing was written: the translator lowers it
    return True


class _NotOneValue(Exception):
    """An input of the chosen ATen node is not one ONNX value."""


class _Writer:
    def __init__(
        self, core: Any, node: torch.fx.Node, values: dict[str, Any], functions: dict[str, Any]
    ) -> None:
        self.core, self.node, self.values, self.functions = core, node, values, functions
        self.made: list[Any] = []

    def write(self, choice: AtenChoice, graph_like: Any, written: list[tuple[Any, int]]) -> None:
        from onnxscript import ir  # noqa: PLC0415 - optional frontend

        node = self.node
        # every input first: a failure leaves the graph and the value table untouched
        inputs = [self._input(v) for v in choice.inputs]
        like = self._input(choice.reshape_like[0]) if choice.reshape_like is not None else None
        given = max(choice.listed, 1)
        aten = ir.Node(
            ATEN_DOMAIN,
            "ATen",
            inputs,
            [ir.AttrString("operator", choice.operator),
             ir.AttrString("overload_name", choice.overload)],
            num_outputs=given + len(choice.extra_outputs),
        )  # fmt: skip
        self.made.append(aten)
        outputs = list(aten.outputs)
        meta = node.meta.get("val")
        metas = list(meta) if choice.listed and isinstance(meta, (list, tuple)) else [meta]
        # named and typed as the translator names and types a lowering's outputs
        for i, (value, value_meta) in enumerate(zip(outputs, metas, strict=False)):
            if isinstance(value_meta, torch.Tensor):
                self.core._set_shape_type(value, value_meta, complex_to_float=True)
            value.name = f"{node.name}__{i}" if choice.listed else f"{node.name}__aten"
        for i, (dtype, rank) in enumerate(choice.extra_outputs, start=given):
            outputs[i].dtype = ir.DataType.from_numpy(np.dtype(_NUMPY[dtype]))
            outputs[i].shape = ir.Shape([None] * rank)
            outputs[i].name = f"{node.name}__aten_{i}"
        aten.name = f"node_{node.name}__aten"
        if choice.listed:
            self.values[node.name] = outputs[: choice.listed]
        elif choice.reshape_like is not None:
            self.values[node.name] = self._reshaped(outputs[0], like, choice.reshape_like[1])
        else:
            outputs[0].name = node.name
            self.values[node.name] = outputs[0]
        added_for(self.core, node, self.made, graph_like)
        written.append((aten, len(inputs)))

    def _reshaped(self, out: Any, like: Any, dim: int) -> Any:
        """``out`` reshaped to the shape of ``like`` (an ONNX value) + ``[dim]``."""
        from onnxscript import ir  # noqa: PLC0415 - optional frontend

        shape = ir.Node("", "Shape", [like])
        self.made.append(shape)
        last = self._input(np.array([dim], np.int64))
        concat = ir.Node("", "Concat", [shape.outputs[0], last], [ir.AttrInt64("axis", 0)])
        reshape = ir.Node("", "Reshape", [out, concat.outputs[0]])
        self.made.extend([concat, reshape])
        result = reshape.outputs[0]
        meta = self.node.meta.get("val")
        if isinstance(meta, torch.Tensor):
            self.core._set_shape_type(result, meta, complex_to_float=True)
        result.name = self.node.name
        return result

    def _input(self, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, np.ndarray):
            made, out = constant(value)
            self.made.append(made)
            return out
        converted = one_value(self.core, value, self.values, self.functions)
        if converted is None:
            raise _NotOneValue(f"{value} is not one ONNX value")
        return converted


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64}
