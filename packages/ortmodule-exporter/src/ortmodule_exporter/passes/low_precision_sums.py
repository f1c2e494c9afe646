"""Low-precision gradient arithmetic the engine writes itself, computed as PyTorch computes it
(a built-graph pass, CPU only).

The export sends every operator on a bfloat16 or float16 tensor to PyTorch
(:mod:`ortmodule_exporter.aten.low_precision`), but the engine's gradient builder adds nodes
of its own: the sum of an output's gradient from the caller and from inside the graph
(``<output>_grad_add``), the sums of a value's gradients from several consumers (``Sum``),
and the gradients of the data movement left in the engine. At bfloat16 the CPU engine has no
kernel for them (``Add``, ``Sum``, ``ReduceSum``, ...).

PyTorch's CPU kernels for bfloat16 and float16 compute in float32 and round each result once,
so each such node becomes ``Cast`` to float32, the node, ``Cast`` back: the same numbers as
eager's kernel, node for node. A ``Sum`` of more than two gradients becomes a chain of such
additions, as autograd accumulates them one at a time. Nodes of other types are left as they
are; the session then names the operator it has no kernel for.

>>> from ortmodule_exporter.passes.low_precision_sums import compute_in_float32
>>> compute_in_float32(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import onnx

from ..aten.low_precision import CPU_KERNELS
from ..onnx_graph import value_shapes
from .built_graph import register_built_graph_pass

__all__ = ["compute_in_float32"]

_ONNX_NAMES: dict[int, str] = {
    int(onnx.TensorProto.BFLOAT16): "BFloat16",
    int(onnx.TensorProto.FLOAT16): "Half",
}

#: op types whose float outputs have the dtype of their float inputs, and which of their inputs
#: carry that dtype (None: every input)
_SAME_DTYPE: dict[str, tuple[int, ...] | None] = {
    "Add": None,
    "Sub": None,
    "Mul": None,
    "Div": None,
    "Neg": None,
    "Sum": None,
    "ReduceSum": (0,),
    "ReduceMean": (0,),
    "Expand": (0,),
    "Tile": (0,),
    "Pad": (0, 2),
    "Where": (1, 2),
    "GatherGrad": (2,),
    "GatherElementsGrad": (0,),
}


def _low(dtype: int | None) -> bool:
    return dtype in _ONNX_NAMES


def compute_in_float32(model: onnx.ModelProto) -> int:
    """Rewrite the graph's low-precision nodes that the CPU engine has no kernel for; returns
    how many were rewritten."""
    graph = model.graph
    known = {name: dtype for name, (dtype, _) in value_shapes(graph).items()}
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        slots = _SAME_DTYPE.get(node.op_type, ())
        if node.domain not in ("", "ai.onnx", "com.microsoft") or slots == ():
            nodes.append(node)
            _propagate(node, known)
            continue
        carried = range(len(node.input)) if slots is None else slots
        dtypes = {
            known.get(node.input[i]) for i in carried if i < len(node.input) and node.input[i]
        }
        low = [d for d in dtypes if d is not None and _low(d)]
        if len(low) != 1 or node.op_type in CPU_KERNELS[_ONNX_NAMES[low[0]]]:
            nodes.append(node)
            _propagate(node, known)
            continue
        dtype = low[0]
        tag = node.name or node.output[0]
        if node.op_type == "Sum" and len(node.input) > 2:
            total = node.input[0]
            for k, term in enumerate(node.input[1:], start=1):
                last = k == len(node.input) - 1
                out = node.output[0] if last else f"{tag}/partial{k}"
                add = onnx.helper.make_node("Add", [total, term], [out], name=f"{tag}/add{k}")
                nodes.extend(_in_float32(add, range(2), dtype))
                total = out
        else:
            nodes.extend(_in_float32(node, carried, dtype))
        for out in node.output:
            if out:
                known[out] = dtype
        changed += 1
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _in_float32(node: onnx.NodeProto, carried: Any, dtype: int) -> list[onnx.NodeProto]:
    """``node`` with its ``carried`` inputs cast to float32 and its outputs cast back."""
    tag = node.name or node.output[0]
    inner = onnx.NodeProto()
    inner.CopyFrom(node)
    inner.name = f"{tag}/float32"
    casts: list[onnx.NodeProto] = []
    for i in carried:
        if i < len(node.input) and node.input[i]:
            wide = f"{tag}/in{i}_float32"
            casts.append(
                onnx.helper.make_node(
                    "Cast",
                    [node.input[i]],
                    [wide],
                    name=f"{tag}/cast_in{i}",
                    to=onnx.TensorProto.FLOAT,
                )
            )
            inner.input[i] = wide
    backs: list[onnx.NodeProto] = []
    for k, out in enumerate(node.output):
        if out:
            wide = f"{tag}/out{k}_float32"
            inner.output[k] = wide
            backs.append(
                onnx.helper.make_node("Cast", [wide], [out], name=f"{tag}/cast_out{k}", to=dtype)
            )
    return [*casts, inner, *backs]


def _propagate(node: onnx.NodeProto, known: dict[str, int]) -> None:
    """Carry a dtype through a node the pass keeps, where the graph left its output untyped."""
    if node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to is not None and node.output and node.output[0] not in known:
            known[node.output[0]] = to
        return
    slots = _SAME_DTYPE.get(node.op_type)
    if node.op_type in CPU_KERNELS["BFloat16"] - {"Shape"} or slots is not None:
        first = next((known[i] for i in node.input if i in known), None)
        if first is not None:
            for out in node.output:
                if out and out not in known:
                    known[out] = first


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    if config.device_type != "cpu":
        return False
    return compute_in_float32(model) > 0


register_built_graph_pass("low_precision_sums", _pass, order=70)
