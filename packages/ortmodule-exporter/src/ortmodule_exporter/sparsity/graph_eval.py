"""Run an exported forward graph with ONNX Runtime on one batch, for the checks the sparsity
rewrites make at graph build (:func:`evaluate_graph`): training-mode dropout is probed off.

>>> from ortmodule_exporter.sparsity.graph_eval import evaluate_graph
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch

from ..aten import executor as aten_executor
from ..aten.executor import ATEN_DOMAIN
from ..engine_binding import import_onnxruntime
from ..named_dims import infer_symbolic_shapes

__all__ = ["evaluate_graph"]

#: the name of the probe's training-mode input set to false
_NO_TRAINING = "padding_elimination/probe_training_mode_false"


_DROPOUT = frozenset({"Dropout", "BitmaskDropout"})


def evaluate_graph(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    outputs: list[str] | None = None,
    types: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Every node output of ``model``'s graph (or ``outputs``) on ``feeds``, by ONNX Runtime.

    Graph inputs missing from ``feeds`` get zeros of their declared shape. PyTorch-run (ATen)
    nodes run through the exporter's executor; their outputs' element types come from ``types``
    (value name -> ONNX element type) or, without it, from symbolic shape inference."""
    ort = import_onnxruntime()
    aten_executor.install()
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    graph = probe.graph
    names = outputs or [o for n in graph.node for o in n.output if o]
    # element types (no shapes, which the rewrite changes) where ONNX Runtime cannot infer
    # them: an ATen node's outputs
    known = {vi.name: vi.type.tensor_type.elem_type for vi in (*graph.value_info, *graph.output)}
    if types is None and any(
        n.domain == ATEN_DOMAIN and any(o not in known for o in n.output) for n in graph.node
    ):
        inferred = infer_symbolic_shapes(model).graph
        types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.value_info}
    known = {**(types or {}), **known}
    # dropout off: two runs must give the same outputs to be compared
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(False), _NO_TRAINING))
    for node in graph.node:
        if node.op_type in _DROPOUT:
            inputs = [*node.input[:2], *[""] * (2 - len(node.input[:2])), _NO_TRAINING]
            del node.input[:]
            node.input.extend(inputs)
    del graph.output[:]
    del graph.value_info[:]
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    graph.value_info.extend(
        onnx.helper.make_tensor_value_info(o, known[o], None)
        for n in graph.node
        if n.domain == ATEN_DOMAIN
        for o in n.output
        if o and known.get(o)
    )
    values: dict[str, np.ndarray] = {}
    for vi in graph.input:  # the inputs as fed are part of the answer too
        value = feeds.get(vi.name)
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if value is None:
            t = vi.type.tensor_type
            value = np.zeros(
                [d.dim_value for d in t.shape.dim],
                dtype=onnx.helper.tensor_dtype_to_np_dtype(t.elem_type),
            )
        values[vi.name] = np.asarray(value)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    # PyTorch-run nodes may draw from the user's generators; the probe leaves them as they were
    with torch.random.fork_rng(devices=[]):
        results = session.run(names, values)
    return {**values, **dict(zip(names, results, strict=True))}
