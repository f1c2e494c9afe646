"""The engine's GELU gradients on PyTorch's ``gelu_backward`` where it measured faster (a
built-graph pass).

The engine fuses a GELU written out in arithmetic into its own node at graph build: Hugging
Face GPT-2's ``NewGELUActivation`` (``0.5 * x * (1 + tanh(...))``) becomes ``FastGelu``, and the
gradient builder differentiates it with ``FastGeluGrad``. That CPU kernel is slow: 62 ms for one
``(1024, 3072)`` MLP activation of GPT-2 124M against 3 ms for PyTorch's
``gelu_backward(approximate="tanh")`` (2 threads), about 0.55 s of a 6.4 s training step
(``python -m benchmarks.breakdown --model gpt2_124m``). The exported graph holds no ``aten::gelu``
for the kernel choice's symbolic to route, so the choice is made here, on the built graph: each
float32 ``FastGeluGrad`` (``GeluGrad``) becomes an ATen node (``_ortmodule_gelu_backward``,
overload ``tanh`` (``none``)) where :func:`~ortmodule_exporter.aten.kernel_choice.gelu_backward_route`
chooses PyTorch. The forward ``FastGelu`` stays the engine's (it is fast), and so does every
node the memory optimizer may recompute: this rewrites backward nodes only.

The two compute the same derivative; results are equal up to float rounding.
``ORTMODULE_KERNEL_CHOICE`` governs it like every other covered operator (``engine`` keeps the
engine's nodes); graphs built for CUDA keep them (the timing is a CPU one).

>>> from ortmodule_exporter.passes.gelu_grads import route_gelu_grads
>>> route_gelu_grads(model, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any

import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import ENGINE_GELU_GRADS, GELU_BACKWARD, current_mode, gelu_backward_route
from ..onnx_graph import value_shapes
from .built_graph import register_built_graph_pass

__all__ = ["route_gelu_grads"]

_APPROXIMATE = {op: approximate for approximate, op in ENGINE_GELU_GRADS.items()}
_MS = "com.microsoft"


def route_gelu_grads(model: onnx.ModelProto, device_type: str) -> int:
    """Rewrite the float32 ``GeluGrad``/``FastGeluGrad`` nodes (two inputs: no bias) the kernel
    choice runs on PyTorch; returns how many were rewritten."""
    if device_type != "cpu" or current_mode() == "engine":
        return 0
    graph = model.graph
    shapes = value_shapes(graph)
    changed = 0
    for position, node in enumerate(list(graph.node)):
        approximate = _APPROXIMATE.get(node.op_type)
        if approximate is None or node.domain != _MS or len(node.input) != 2:
            continue
        # untyped where the build kept no value_info for it: the engine's CPU kernels of both
        # nodes are float32 only
        elem_type, dims = shapes.get(node.input[1], (onnx.TensorProto.FLOAT, None))
        if elem_type != onnx.TensorProto.FLOAT:
            continue
        sizes = [d for d in dims or [] if d]
        numel = math.prod(sizes) if dims and len(sizes) == len(dims) else None
        if gelu_backward_route(numel, approximate) != "torch":
            continue
        graph.node[position].CopyFrom(
            onnx.helper.make_node(
                "ATen",
                list(node.input),
                list(node.output),
                name=f"{node.name}_gelu_backward",
                domain=ATEN_DOMAIN,
                operator=GELU_BACKWARD,
                overload_name=approximate,
            ),
        )
        changed += 1
    return changed


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return route_gelu_grads(model, config.device_type) > 0


register_built_graph_pass("gelu_grads", _pass, order=61)
