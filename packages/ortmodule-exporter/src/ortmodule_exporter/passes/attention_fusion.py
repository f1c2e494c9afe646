"""Attention fusion (``ORTMODULE_USE_EFFICIENT_ATTENTION``, post-export pass order 30).

The unfused attention pattern ``Softmax(Q @ K^T * scale [+ mask]) @ V`` becomes one ATen node
running PyTorch's fused attention kernel (see :func:`fuse_attention`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from ..aten.executor import ATEN_DOMAIN
from ..onnx_graph import attribute, import_domain, producers_and_consumers
from .registry import register_post_export_pass

logger = logging.getLogger("ortmodule.exporter")

# -- attention fusion (ORTMODULE_USE_EFFICIENT_ATTENTION) ---------------------------------------------

__all__ = ["fuse_attention"]


_FLOATS = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    }
)


def _scalar_constant(
    graph: onnx.GraphProto, name: str, producers: Mapping[str, onnx.NodeProto]
) -> float | None:
    node = producers.get(name)
    array = None
    if node is not None and node.op_type == "Cast" and attribute(node, "to", 0) in _FLOATS:
        # the torch_export frontend casts its Python scalars to the tensor's dtype
        # (scalar_tensor then Cast)
        return _scalar_constant(graph, node.input[0], producers)
    if node is not None and node.op_type == "Constant":
        for a in node.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                array = onnx.numpy_helper.to_array(a.t)
    else:
        for init in graph.initializer:
            if init.name == name:
                array = onnx.numpy_helper.to_array(init)
    if array is None or array.size != 1:
        return None
    return float(np.asarray(array).reshape(-1)[0])


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001
        return {}
    ranks = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    return ranks


def fuse_attention(model: onnx.ModelProto) -> int:
    """Replace ``MatMul(Softmax(MatMul(Q, Transpose(K)) {*,/} c [+ mask]), V)`` on 4-D tensors
    with PyTorch's fused attention (an ATen node); returns how many were fused."""
    graph = model.graph
    producers, consumers = producers_and_consumers(graph)
    outputs = {o.name for o in graph.output}
    ranks = _ranks(model)

    def single_use(name: str) -> bool:
        return len(consumers.get(name, [])) == 1 and name not in outputs

    fused = 0
    removed: set[int] = set()
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        probs, v = node.input
        softmax = producers.get(probs)
        if softmax is None or softmax.op_type != "Softmax" or not single_use(probs):
            continue
        axis = attribute(softmax, "axis", -1)
        if axis not in (-1, 3):
            continue
        chain = [softmax]
        scores = softmax.input[0]
        mask = ""
        step = producers.get(scores)
        if step is not None and step.op_type == "Add" and single_use(scores):
            chain.append(step)
            left, right = step.input
            left_node = producers.get(left)
            if left_node is not None and left_node.op_type in ("Mul", "Div", "MatMul"):
                scores, mask = left, right
            else:
                scores, mask = right, left
            step = producers.get(scores)
        scale = 1.0
        if step is not None and step.op_type in ("Mul", "Div") and single_use(scores):
            c = _scalar_constant(graph, step.input[1], producers)
            if c is None or c == 0.0:
                continue
            scale = c if step.op_type == "Mul" else 1.0 / c
            chain.append(step)
            scores = step.input[0]
            step = producers.get(scores)
        if step is None or step.op_type != "MatMul" or not single_use(scores):
            continue
        chain.append(step)
        q, kt = step.input
        transpose = producers.get(kt)
        if transpose is None or transpose.op_type != "Transpose" or not single_use(kt):
            continue
        if list(attribute(transpose, "perm", [])) != [0, 1, 3, 2]:
            continue
        chain.append(transpose)
        k = transpose.input[0]
        if any(ranks.get(x) != 4 for x in (q, k, v)):
            continue
        tag = f"fused_attention_{fused}"
        scale_name = f"{tag}_scale"
        constants = [
            onnx.helper.make_node(
                "Constant",
                [],
                [f"{tag}_dropout"],
                value=onnx.numpy_helper.from_array(np.array(0.0)),
            ),
            onnx.helper.make_node(
                "Constant",
                [],
                [f"{tag}_causal"],
                value=onnx.numpy_helper.from_array(np.array(False)),
            ),
            onnx.helper.make_node(
                "Constant", [], [scale_name], value=onnx.numpy_helper.from_array(np.array(scale))
            ),
        ]
        attention = onnx.helper.make_node(
            "ATen",
            [q, k, v, f"{tag}_dropout", f"{tag}_causal", mask, scale_name],
            [node.output[0], f"{tag}_logsumexp"],
            name=tag,
            domain=ATEN_DOMAIN,
            operator="_scaled_dot_product_flash_attention_for_cpu",
            overload_name="",
        )
        position = list(graph.node).index(node)
        for extra in reversed([*constants, attention]):
            graph.node.insert(position, extra)
        dead = {id(n) for n in [*chain, node]}
        removed |= dead
        fused += 1
    if fused:
        keep = [n for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(keep)
        import_domain(model, ATEN_DOMAIN)
    return fused


def _attention_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    if exported.config.efficient_attention:
        n = fuse_attention(exported.model)
        if n:
            logger.info("fused %d attention pattern(s) into PyTorch's attention kernel", n)


register_post_export_pass("aten_efficient_attention", _attention_pass, order=30)
