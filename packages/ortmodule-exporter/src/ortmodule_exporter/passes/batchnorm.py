"""The BatchNorm running-statistics pass (post-export pass order 10).

See :func:`expose_batchnorm_running_stats` and :func:`decompose_eval_batchnorm` (order 11).
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


def decompose_eval_batchnorm(exported: ExportedModel, _options: Mapping[str, Any]) -> None:
    """Spell an inference-mode BatchNormalization in a training graph as elementwise ops.

    Engine workaround (onnxruntime-training 1.19.2): the gradient build rewrites every
    BatchNormalization into BatchNormInternal with ``training_mode=1`` (its
    ``BatchNormReplacement`` rule), so a node that must normalize with the given running
    statistics (``F.batch_norm(..., training=False)``, a BatchNorm layer put in eval mode inside
    a module that trains) normalizes with the batch's statistics instead, and its gradient is
    the batch-statistics one. ``(x - mean) * (weight / sqrt(var + eps)) + bias`` with the
    per-channel values reshaped to ``(C, 1, ..., 1)`` is the same computation, and the engine
    differentiates it like PyTorch does (the statistics are constants of the normalization).
    """
    if not exported.training:
        return
    graph = exported.model.graph
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in (*graph.input, *graph.value_info, *graph.output)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type
    }
    types.update({t.name: t.data_type for t in graph.initializer})
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        attrs = {a.name: a for a in node.attribute}
        if (
            node.op_type != "BatchNormalization"
            or node.domain not in ("", "ai.onnx")
            or len(node.input) < 5
            or (attrs["training_mode"].i if "training_mode" in attrs else 0) != 0
        ):
            nodes.append(node)
            continue
        x, weight, bias, mean, var = node.input[:5]
        eps = attrs["epsilon"].f if "epsilon" in attrs else 1e-5
        tag = f"eval_bn{index}"
        stat_type = types.get(var, types.get(x, onnx.TensorProto.FLOAT))
        x_type = types.get(x, stat_type)
        eps_value = np.array(eps, dtype=onnx.helper.tensor_dtype_to_np_dtype(stat_type))
        if x_type != stat_type:
            # compute in the statistics' type (float for half inputs), as PyTorch does
            nodes.append(h.make_node("Cast", [x], [f"{tag}_x"], to=stat_type))
            x = f"{tag}_x"
        nodes += [
            # (C, 1, ..., 1): -1 followed by rank(x) - 2 ones, whatever x's rank
            h.make_node("Shape", [x], [f"{tag}_shape"]),
            h.make_node("Shape", [f"{tag}_shape"], [f"{tag}_rank"]),
            h.make_node(
                "Constant", [], [f"{tag}_two"], value=onnx.numpy_helper.from_array(np.array([2]))
            ),
            h.make_node("Sub", [f"{tag}_rank", f"{tag}_two"], [f"{tag}_spatial"]),
            h.make_node(
                "ConstantOfShape",
                [f"{tag}_spatial"],
                [f"{tag}_ones"],
                value=onnx.numpy_helper.from_array(np.array([1])),
            ),
            h.make_node(
                "Constant",
                [],
                [f"{tag}_minus1"],
                value=onnx.numpy_helper.from_array(np.array([-1])),
            ),
            h.make_node("Concat", [f"{tag}_minus1", f"{tag}_ones"], [f"{tag}_cshape"], axis=0),
            h.make_node(
                "Constant", [], [f"{tag}_eps"], value=onnx.numpy_helper.from_array(eps_value)
            ),
            h.make_node("Add", [var, f"{tag}_eps"], [f"{tag}_var_eps"]),
            h.make_node("Sqrt", [f"{tag}_var_eps"], [f"{tag}_std"]),
            h.make_node("Div", [weight, f"{tag}_std"], [f"{tag}_scale"]),
            h.make_node("Reshape", [f"{tag}_scale", f"{tag}_cshape"], [f"{tag}_scale_c"]),
            h.make_node("Reshape", [mean, f"{tag}_cshape"], [f"{tag}_mean_c"]),
            h.make_node("Reshape", [bias, f"{tag}_cshape"], [f"{tag}_bias_c"]),
            h.make_node("Sub", [x, f"{tag}_mean_c"], [f"{tag}_centered"]),
            h.make_node("Mul", [f"{tag}_centered", f"{tag}_scale_c"], [f"{tag}_scaled"]),
        ]
        y = node.output[0]
        if x_type != stat_type:
            nodes.append(h.make_node("Add", [f"{tag}_scaled", f"{tag}_bias_c"], [f"{tag}_y"]))
            nodes.append(h.make_node("Cast", [f"{tag}_y"], [y], to=x_type))
        else:
            nodes.append(h.make_node("Add", [f"{tag}_scaled", f"{tag}_bias_c"], [y]))
    del graph.node[:]
    graph.node.extend(nodes)


register_post_export_pass("batchnorm_eval_decomposition", decompose_eval_batchnorm, order=11)
