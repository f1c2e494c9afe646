"""Post-export graph passes: edits of the exported ONNX model made before the gradient build.

Other packages add passes here (memory-efficient gradients, density flags, ZeRO-3) instead of
the runtime importing their internals.

Example::

    from ortmodule_exporter import register_post_export_pass

    def tag_graph(exported, options):
        exported.model.doc_string = "tagged"

    register_post_export_pass("tag", tag_graph, order=50)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from .export import ExportedModel

PassFn = Callable[[ExportedModel, Mapping[str, Any]], None]


@dataclass(frozen=True)
class PostExportPass:
    name: str
    fn: PassFn
    order: int


_PASSES: dict[str, PostExportPass] = {}
_LOCK = threading.Lock()


def register_post_export_pass(name: str, fn: PassFn, order: int = 100) -> None:
    """Run ``fn(exported, options)`` after every export; lower ``order`` runs first."""
    with _LOCK:
        _PASSES[name] = PostExportPass(name, fn, order)


def unregister_post_export_pass(name: str) -> None:
    with _LOCK:
        _PASSES.pop(name, None)


def run_post_export_passes(exported: ExportedModel, options: Mapping[str, Any] | None = None) -> list[str]:
    """Apply every registered pass in order; returns the names that ran."""
    with _LOCK:
        passes = sorted(_PASSES.values(), key=lambda p: (p.order, p.name))
    for p in passes:
        p.fn(exported, options or {})
    return [p.name for p in passes]


def expose_batchnorm_running_stats(exported: ExportedModel, _options: Mapping[str, Any]) -> None:
    """Make a training-mode BatchNormalization's new running mean/var graph outputs.

    The TorchScript exporter drops these in-place buffer updates; we add them as extra outputs
    and the runtime copies them into the module's buffers after each forward, so the user's
    module sees the same running statistics as in eager. The engine folds the population
    variance into the running variance while PyTorch folds the unbiased one, so the variance
    update is rescaled by n/(n-1) inside the graph.
    """
    graph = exported.model.graph
    params = set(exported.param_names)
    elem_type = {vi.name: vi.type.tensor_type.elem_type for vi in graph.input}
    existing = {o.name for o in graph.output}
    added: list[onnx.NodeProto] = []
    opset = next((o.version for o in exported.model.opset_import if o.domain in ("", "ai.onnx")), 17)
    ranks = _value_ranks(exported.model)
    for index, node in enumerate(list(graph.node)):
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        attrs = {a.name: a for a in node.attribute}
        if "training_mode" not in attrs or attrs["training_mode"].i != 1:
            continue
        mean, var = node.input[3], node.input[4]
        if mean not in params or var not in params:
            continue
        momentum = attrs["momentum"].f if "momentum" in attrs else 0.9
        while len(node.output) < 3:
            node.output.append("")
        tag = f"bn{index}"
        for slot in (1, 2):
            if not node.output[slot]:
                node.output[slot] = f"{tag}_running_{slot}"
        mean_out = f"buffer_update.{mean}"
        var_out = f"buffer_update.{var}"
        if mean_out in existing or var_out in existing:
            continue
        rank = ranks.get(node.input[0])
        if rank is None:
            continue
        dtype = elem_type.get(var, onnx.TensorProto.FLOAT)
        added += [onnx.helper.make_node("Identity", [node.output[1]], [mean_out])]
        added += _unbiased_running_var(tag, node.input[0], node.output[2], var_out, momentum, dtype, rank, opset)
        for name in (mean_out, var_out):
            graph.output.append(onnx.helper.make_tensor_value_info(name, dtype, None))
            existing.add(name)
        exported.buffer_updates[mean_out] = mean
        exported.buffer_updates[var_out] = var
    graph.node.extend(added)


def _value_ranks(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - no ranks means no correction, never a failed export
        return {}
    ranks = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            ranks[vi.name] = len(t.shape.dim)
    return ranks


def _unbiased_running_var(
    tag: str, x: str, new: str, out: str, momentum: float, dtype: int, rank: int, opset: int
) -> list[onnx.NodeProto]:
    """out = new + (1 - m) * var_biased(x) / (n - 1), n = elements per channel of ``x``.

    Only ``x`` and the kernel's new value are read: the engine's training BatchNorm updates the
    running buffers in place, so the old value is gone once the node has run.
    """
    h = onnx.helper
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    axes = [0, *range(2, rank)]
    p = f"{tag}_uv_"

    def const(name: str, value: Any, dt: Any = np_dtype) -> onnx.NodeProto:
        return h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(value, dtype=dt)))

    def reduce_mean(inp: str, outp: str, keep: int) -> list[onnx.NodeProto]:
        if opset >= 18:
            return [h.make_node("ReduceMean", [inp, p + "axes"], [outp], keepdims=keep)]
        return [h.make_node("ReduceMean", [inp], [outp], axes=axes, keepdims=keep)]

    nodes = [const(p + "axes", axes, np.int64)] if opset >= 18 else []
    nodes += reduce_mean(x, p + "mean", 1)
    nodes += [
        h.make_node("Sub", [x, p + "mean"], [p + "centered"]),
        h.make_node("Mul", [p + "centered", p + "centered"], [p + "sq"]),
    ]
    nodes += reduce_mean(p + "sq", p + "var_b", 0)
    nodes += [
        h.make_node("Size", [x], [p + "size"]),
        h.make_node("Shape", [x], [p + "shape"]),
        const(p + "channel_axis", 1, np.int64),
        h.make_node("Gather", [p + "shape", p + "channel_axis"], [p + "c"]),
        h.make_node("Cast", [p + "size"], [p + "size_f"], to=dtype),
        h.make_node("Cast", [p + "c"], [p + "c_f"], to=dtype),
        h.make_node("Div", [p + "size_f", p + "c_f"], [p + "n"]),
        const(p + "one", 1.0),
        const(p + "w", 1.0 - momentum),
        h.make_node("Sub", [p + "n", p + "one"], [p + "nm1"]),
        h.make_node("Div", [p + "w", p + "nm1"], [p + "scale"]),
        h.make_node("Mul", [p + "var_b", p + "scale"], [p + "extra"]),
        h.make_node("Add", [new, p + "extra"], [out]),
    ]
    return nodes


register_post_export_pass("batchnorm_running_stats", expose_batchnorm_running_stats, order=10)
