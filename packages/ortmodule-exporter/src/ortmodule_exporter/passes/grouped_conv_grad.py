"""Grouped convolution gradients off the engine's faulty kernel path (a built-graph pass).

Engine bug (onnxruntime-training 1.19.2, CPU ``com.microsoft::ConvGrad``): for a convolution
with ``group > 1`` and a kernel rank other than 2, the input gradient is written group by group
with ``math::Col2imNdPar``, which first zero-fills ``img_size`` elements of the image, and the
kernel passes ``C * input_image_size`` (all channels) as that size while each group's image is
only ``C / group * input_image_size`` long. Every group's call therefore clears the memory after
its own slice, and the last one clears ``(group - 1) / group`` of an image past the end of
``dX``: whatever tensor the engine placed there loses values. ``dX`` itself is right (each
slice is cleared before it is accumulated); the damage shows up elsewhere: a depthwise
``Conv1d`` (Mamba's short convolution) made ``D.grad`` of the selective-scan block wrong by 43 %
at batch 2, and the engine's own shape tensors (``BroadcastGradientArgs`` axes, ``Shape``
outputs) read back as zeros, which ended in "cannot reshape {1,6,32} to {32}" in a 2-layer
block (issue #36, measured 2026-11-26 on the 2-core CPU machine). The 2-D path
(``Col2imPar``) clears ``C / group`` channels and is right.

So a grouped ConvGrad with one spatial dim is run as the 2-D ConvGrad of the same convolution
with a height of 1: ``dY``, ``X`` and ``W`` get an ``Unsqueeze`` at axis 2 (``kernel_shape
[k] -> [1, k]``, ``pads [b, e] -> [0, b, 0, e]``, strides and dilations get a leading 1), and
``dX``/``dW`` a ``Squeeze`` of that axis (``dB`` is the same). Unsqueeze and Squeeze are views
in the engine; the 2-D gradients equal PyTorch's within fp32 tolerance (tests). It is also
quicker: a depthwise ConvGrad (kernel 4) on ``(8, 256, 128)`` took 13.1 ms as 1-D and 1.7 ms
as 2-D (``kernel_choice.measuring._engine_us``, 2026-11-26, the 2-core CPU machine). Graphs
built for CUDA keep the node (cuDNN computes the gradient there).

A grouped ``Conv3d`` takes the same broken path (measured 2026-11-26 on the same machine: the
backward of a depthwise ``Conv3d(8, 8, 3, groups=8)`` on a ``(2, 8, 3, 4, 4)`` input cleared
336 = 7 * 48 elements of the module's output the user still held) and has no 2-D form: its
ConvGrad becomes PyTorch's ``convolution_backward`` inside the engine (the ATen node
``_ortmodule_conv_backward`` the kernel choice uses), whatever ``ORTMODULE_KERNEL_CHOICE`` says,
when the input gradient is wanted and the padding is symmetric. An asymmetric explicit padding
(not something PyTorch exports) is left on the engine's kernel.

>>> from ortmodule_exporter.passes.grouped_conv_grad import route_grouped_conv_grads
>>> route_grouped_conv_grads(model, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import CONV_BACKWARD
from ..onnx_graph import attribute, value_shapes
from .built_graph import register_built_graph_pass

__all__ = ["route_grouped_conv_grads"]

_MS_DOMAIN = "com.microsoft"


def _spatial_rank(node: onnx.NodeProto, shapes: dict[str, Any]) -> int | None:
    """The number of spatial dims of the convolution ``node`` (a ConvGrad) differentiates."""
    kernel = attribute(node, "kernel_shape")
    if kernel:
        return len(kernel)
    known = shapes.get(node.input[2])  # the weight: (M, C / group, *kernel)
    if known is not None and known[1] is not None:
        return len(known[1]) - 2
    return None


def route_grouped_conv_grads(model: onnx.ModelProto, device_type: str) -> int:
    """Rewrite every grouped 1-D ``ConvGrad`` as the 2-D one and every grouped ``ConvGrad`` of 3
    or more spatial dims as PyTorch's; returns how many were rewritten."""
    if device_type != "cpu":
        return 0
    graph = model.graph
    shapes = value_shapes(graph)
    axes = "_ortmodule_grouped_conv_grad_axis2"
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        rank = _spatial_rank(node, shapes) if node.op_type == "ConvGrad" else None
        if node.domain != _MS_DOMAIN or attribute(node, "group", 1) <= 1 or rank in (None, 2):
            nodes.append(node)
            continue
        if rank != 1:
            routed = _on_pytorch(node, rank, graph)
            nodes.extend(routed or [node])
            changed += bool(routed)
            continue
        tag = f"{node.name or node.output[1]}__as_2d"
        lifted = [f"{tag}/{slot}" for slot in ("dY", "X", "W")]
        nodes.extend(
            onnx.helper.make_node("Unsqueeze", [source, axes], [target])
            for source, target in zip(node.input[:3], lifted, strict=True)
        )
        outputs = list(node.output) + [""] * (3 - len(node.output))
        d_x, d_w, d_b = outputs
        new_outputs = [f"{tag}/dX" if d_x else "", f"{tag}/dW" if d_w else "", d_b]
        attrs: dict[str, Any] = {"group": attribute(node, "group")}
        kernel = attribute(node, "kernel_shape")
        if kernel:
            attrs["kernel_shape"] = [1, *kernel]
        pads = attribute(node, "pads")
        if pads:
            attrs["pads"] = [0, pads[0], 0, pads[1]]
        for name in ("strides", "dilations"):
            value = attribute(node, name)
            if value:
                attrs[name] = [1, *value]
        auto_pad = attribute(node, "auto_pad")
        if auto_pad:
            attrs["auto_pad"] = auto_pad
        while new_outputs and not new_outputs[-1]:
            new_outputs.pop()
        nodes.append(
            onnx.helper.make_node(
                "ConvGrad", lifted, new_outputs, name=tag, domain=_MS_DOMAIN, **attrs
            )
        )
        for lowered, original in ((new_outputs[0], d_x), (f"{tag}/dW" if d_w else "", d_w)):
            if original:
                nodes.append(onnx.helper.make_node("Squeeze", [lowered, axes], [original]))
        changed += 1
    if changed:
        if not any(t.name == axes for t in graph.initializer):
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([2], np.int64), axes))
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _on_pytorch(node: onnx.NodeProto, rank: int, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """``node`` (a grouped ConvGrad of ``rank`` spatial dims) as PyTorch's convolution backward
    in an ATen node, or nothing when it cannot be (no input gradient wanted: the faulty
    loop does not run; an asymmetric padding or ``auto_pad``: PyTorch has no such setting)."""
    outputs = list(node.output) + [""] * (3 - len(node.output))
    d_x, d_w, d_b = outputs
    pads = attribute(node, "pads") or [0] * (2 * rank)
    auto_pad = attribute(node, "auto_pad") or "NOTSET"
    if not d_x or auto_pad != "NOTSET" or list(pads[:rank]) != list(pads[rank:]):
        return []
    params = [
        *(attribute(node, "strides") or [1] * rank),
        *pads[:rank],
        *(attribute(node, "dilations") or [1] * rank),
        attribute(node, "group"),
    ]
    tag = f"{node.name or d_x}__on_pytorch"
    graph.initializer.append(
        onnx.numpy_helper.from_array(np.array(params, np.int64), f"{tag}/params")
    )
    wanted = [d_x, d_w or f"{tag}/dW_unused"] + ([d_b] if d_b else [])
    return [
        onnx.helper.make_node(
            "ATen",
            [*node.input[:3], f"{tag}/params"],
            wanted,
            name=tag,
            domain=ATEN_DOMAIN,
            operator=CONV_BACKWARD,
            overload_name="xwb" if d_b else "xw",
        )
    ]


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return route_grouped_conv_grads(model, config.device_type) > 0


register_built_graph_pass("grouped_conv_grad", _pass, order=58)
