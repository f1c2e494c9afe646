"""The BatchNorm running-statistics pass (post-export pass order 10).

See :func:`expose_batchnorm_running_stats`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from ..export.model import ExportedModel
from .registry import register_post_export_pass


def expose_batchnorm_running_stats(exported: ExportedModel, _options: Mapping[str, Any]) -> None:
    """Make a training-mode BatchNormalization's new running mean/var graph outputs.

    The TorchScript exporter drops these in-place buffer updates; we add them as extra outputs
    and the runtime copies them into the module's buffers after each forward, so the user's
    module sees the same running statistics as in eager. The engine folds the population
    variance into the running variance while PyTorch folds the unbiased one; the graph also
    outputs the element count per channel (an integer, so no gradient flows through it) and
    the runtime rescales the update by n/(n-1).
    """
    graph = exported.model.graph
    params = set(exported.param_names)
    elem_type = {vi.name: vi.type.tensor_type.elem_type for vi in graph.input}
    existing = {o.name for o in graph.output}
    added: list[onnx.NodeProto] = []
    h = onnx.helper
    for index, node in enumerate(list(graph.node)):
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        attrs = {a.name: a for a in node.attribute}
        if "training_mode" not in attrs or attrs["training_mode"].i != 1:
            continue
        mean, var = node.input[3], node.input[4]
        mean_out, var_out = f"buffer_update.{mean}", f"buffer_update.{var}"
        if mean not in params or var not in params or mean_out in existing or var_out in existing:
            continue
        while len(node.output) < 3:
            node.output.append("")
        tag = f"bn{index}"
        for slot in (1, 2):
            if not node.output[slot]:
                node.output[slot] = f"{tag}_running_{slot}"
        count_out = f"buffer_count.{var}"
        channel_axis = onnx.numpy_helper.from_array(np.array(1, dtype=np.int64))
        added += [
            h.make_node("Identity", [node.output[1]], [mean_out]),
            h.make_node("Identity", [node.output[2]], [var_out]),
            h.make_node("Size", [node.input[0]], [f"{tag}_size"]),
            h.make_node("Shape", [node.input[0]], [f"{tag}_shape"]),
            h.make_node("Constant", [], [f"{tag}_axis"], value=channel_axis),
            h.make_node("Gather", [f"{tag}_shape", f"{tag}_axis"], [f"{tag}_channels"]),
            h.make_node("Div", [f"{tag}_size", f"{tag}_channels"], [count_out]),
        ]
        dtype = elem_type.get(var, onnx.TensorProto.FLOAT)
        graph.output.extend(
            [
                h.make_tensor_value_info(mean_out, dtype, None),
                h.make_tensor_value_info(var_out, dtype, None),
                h.make_tensor_value_info(count_out, onnx.TensorProto.INT64, []),
            ]
        )
        existing |= {mean_out, var_out, count_out}
        exported.buffer_updates[mean_out] = mean
        exported.buffer_updates[var_out] = var
        momentum = attrs["momentum"].f if "momentum" in attrs else 0.9
        exported.variance_updates[var_out] = (count_out, momentum)
    graph.node.extend(added)


register_post_export_pass("batchnorm_running_stats", expose_batchnorm_running_stats, order=10)
