"""Graph outputs get the rank the traced module returned.

Some of PyTorch's symbolics combine a 0-d tensor with a 1-element constant (``log10`` divides
by ``tensor([ln 10])``, ``addcmul`` and ``nan_to_num`` do the like), so ONNX broadcasting turns
a 0-d result into shape ``(1,)``: the module would hand the user a tensor of the wrong shape. The
trace knows each output's rank (the output schema); where it says 0-d, the graph output goes
through a ``Reshape`` to ``[]``, which the engine differentiates.

>>> from ortmodule_exporter.passes.output_ranks import restore_scalar_outputs
>>> restore_scalar_outputs(exported)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from .registry import register_post_export_pass

__all__ = ["restore_scalar_outputs"]


def restore_scalar_outputs(exported: Any) -> int:
    """Reshape every graph output the trace returned 0-d to ``[]``; returns how many."""
    graph = exported.model.graph
    scalar = {spec.name for spec in exported.output_schema.tensor_specs if spec.ndim == 0}
    changed = 0
    for vi in graph.output:
        if vi.name not in scalar:
            continue
        t = vi.type.tensor_type
        if t.HasField("shape") and len(t.shape.dim) == 0:
            continue  # already declared 0-d
        if not any(vi.name in node.output for node in graph.node):
            continue  # a graph input handed straight back keeps its own shape
        raw, shape = f"{vi.name}__before_rank", f"{vi.name}__scalar_shape"
        for node in graph.node:
            node.output[:] = [raw if o == vi.name else o for o in node.output]
            node.input[:] = [raw if i == vi.name else i for i in node.input]
        graph.node.extend(
            [
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [shape],
                    value=onnx.numpy_helper.from_array(np.zeros(0, dtype=np.int64)),
                ),
                onnx.helper.make_node("Reshape", [raw, shape], [vi.name]),
            ]
        )
        t.ClearField("shape")
        t.shape.SetInParent()  # declared rank 0
        changed += 1
    return changed


def _pass(exported: Any, _options: Mapping[str, Any]) -> None:
    restore_scalar_outputs(exported)


register_post_export_pass("scalar_output_ranks", _pass, order=45)
