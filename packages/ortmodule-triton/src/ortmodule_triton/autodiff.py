"""The gradient subgraph of a fusible subgraph, for the verification route's backward kernel.

The gradient model recomputes the forward nodes (cheap next to a kernel launch, and nothing has
to be stashed) and appends each node's vector-Jacobian product as ONNX and ``com.microsoft``
gradient ops (``SoftmaxGrad_13``, ``LayerNormalizationGrad``, ``GeluGrad``, ...), the ops the
engine's own gradient builder emits. Its inputs are the forward inputs followed by one gradient
per forward output (``grad.<name>``); its outputs are the gradients of the floating-point inputs,
computed at the broadcast shape: the caller sums a broadcast input's gradient to its shape.

>>> # model, wrt = gradient_model(forward_model)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from .codegen import model_opset
from .emitter import FLOAT_TYPES
from .errors import TritonCodegenError

__all__ = ["GradientModel", "gradient_model"]

TP = onnx.TensorProto
MS = "com.microsoft"


@dataclass
class GradientModel:
    model: onnx.ModelProto
    #: forward input index of each gradient output, in order
    wrt: list[int]


@dataclass
class _Builder:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    constants: dict[float, str] = field(default_factory=dict)
    grads: dict[str, list[str]] = field(default_factory=dict)
    #: gradient tensors that are already summed over rows (LayerNormalizationGrad scale/bias)
    reduced: set[str] = field(default_factory=set)
    #: tensor name -> ONNX element type (only floating-point tensors take gradients)
    types: dict[str, int] = field(default_factory=dict)
    opset: int = 17
    count: int = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"grad_{self.count}_{hint}"

    def const(self, value: float) -> str:
        if value not in self.constants:
            self.constants[value] = f"grad_const_{len(self.constants)}"
        return self.constants[value]

    def op(self, op_type: str, inputs: list[str], domain: str = "", **attrs: Any) -> str:
        out = self.name(op_type)
        self.nodes.append(onnx.helper.make_node(op_type, inputs, [out], domain=domain, **attrs))
        return out

    def add(self, target: str, grad: str) -> None:
        if self.types.get(target, TP.FLOAT) in FLOAT_TYPES:
            self.grads.setdefault(target, []).append(grad)

    def total(self, target: str) -> str | None:
        parts = self.grads.get(target)
        if not parts:
            return None
        acc = parts[0]
        for p in parts[1:]:
            acc = self.op("Add", [acc, p])
        return acc


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


VJP = Callable[[_Builder, onnx.NodeProto, list[str | None], dict[str, np.ndarray]], None]


def _scalar(consts: dict[str, np.ndarray], name: str, node: onnx.NodeProto, what: str) -> float:
    if name not in consts or consts[name].size != 1:
        raise TritonCodegenError(
            f"node {node.name or node.op_type}: the gradient kernel needs {what} as a constant"
        )
    return float(consts[name].reshape(()))


def _vjp(
    b: _Builder, node: onnx.NodeProto, gs: list[str | None], consts: dict[str, np.ndarray]
) -> None:
    op = node.op_type
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    g = gs[0]
    if g is None:
        if any(x is not None for x in gs[1:]) and op != "Dropout":
            raise TritonCodegenError(f"node {node.name or op}: gradient of a secondary output")
        return
    x = list(node.input)
    y = node.output[0]
    if domain == "" and op in ("Add", "Identity"):
        for i in x[:2] if op == "Add" else x[:1]:
            b.add(i, g)
    elif domain == "" and op == "Sub":
        b.add(x[0], g)
        b.add(x[1], b.op("Neg", [g]))
    elif domain == "" and op == "Mul":
        b.add(x[0], b.op("Mul", [g, x[1]]))
        b.add(x[1], b.op("Mul", [g, x[0]]))
    elif domain == "" and op == "Div":
        ga = b.op("Div", [g, x[1]])
        b.add(x[0], ga)
        b.add(x[1], b.op("Neg", [b.op("Mul", [ga, y])]))
    elif domain == "" and op == "Neg":
        b.add(x[0], b.op("Neg", [g]))
    elif domain == "" and op == "Exp":
        b.add(x[0], b.op("Mul", [g, y]))
    elif domain == "" and op == "Log":
        b.add(x[0], b.op("Div", [g, x[0]]))
    elif domain == "" and op == "Sqrt":
        b.add(x[0], b.op("Div", [b.op("Mul", [g, b.const(0.5)]), y]))
    elif domain == "" and op == "Reciprocal":
        b.add(x[0], b.op("Neg", [b.op("Mul", [b.op("Mul", [g, y]), y])]))
    elif domain == "" and op == "Tanh":
        b.add(x[0], b.op("TanhGrad", [g, y], MS))
    elif domain == "" and op == "Sigmoid":
        b.add(x[0], b.op("SigmoidGrad", [g, y], MS))
    elif domain == "" and op == "Relu":
        b.add(x[0], b.op("ReluGrad", [g, y], MS))
    elif domain == "" and op == "Erf":
        sq = b.op("Mul", [x[0], x[0]])
        e = b.op("Exp", [b.op("Neg", [sq])])
        b.add(x[0], b.op("Mul", [g, b.op("Mul", [e, b.const(2.0 / math.sqrt(math.pi))])]))
    elif domain == "" and op == "Pow":
        c = _scalar(consts, x[1], node, "the exponent")
        p = b.op("Pow", [x[0], b.const(c - 1.0)])
        b.add(x[0], b.op("Mul", [g, b.op("Mul", [p, b.const(c)])]))
    elif domain == "" and op == "Where":
        zero = b.const(0.0)
        b.add(x[1], b.op("Where", [x[0], g, zero]))
        b.add(x[2], b.op("Where", [x[0], zero, g]))
    elif domain == "" and op == "Cast":
        b.add(x[0], b.op("Cast", [g], to=b.types.get(x[0], TP.FLOAT)))
    elif op == "Gelu":
        approx = _attr(node, "approximate", b"none")
        grad_op = "FastGeluGrad" if approx in (b"tanh", "tanh") else "GeluGrad"
        b.add(x[0], b.op(grad_op, [g, x[0]], MS))
    elif domain == MS and op == "BiasGelu":
        gx = b.op("BiasGeluGrad_dX", [g, x[0], x[1]], MS)
        b.add(x[0], gx)
        b.add(x[1], gx)
    elif domain == "" and op in ("Softmax", "LogSoftmax") and b.opset >= 13:
        axis = int(_attr(node, "axis", -1))  # type: ignore[call-overload]
        b.add(x[0], b.op(f"{op}Grad_13", [g, y], MS, axis=axis))
    elif domain == "" and op == "LayerNormalization":
        axis = int(_attr(node, "axis", -1))  # type: ignore[call-overload]
        outs = [b.name("dx"), b.name("dscale"), b.name("dbias")]
        b.nodes.append(
            onnx.helper.make_node(
                "LayerNormalizationGrad",
                [g, x[0], x[1], node.output[1], node.output[2]],
                outs,
                domain=MS,
                axis=axis,
            )
        )
        b.add(x[0], outs[0])
        b.add(x[1], outs[1])
        b.reduced.update(outs[1:])
        if len(x) > 2 and x[2]:
            b.add(x[2], outs[2])
    elif domain == "" and op == "Dropout":
        ratio = _scalar(consts, x[1], node, "the ratio") if len(x) > 1 and x[1] else 0.5
        training = (
            bool(_scalar(consts, x[2], node, "training_mode")) if len(x) > 2 and x[2] else False
        )
        if not training or ratio == 0.0:
            b.add(x[0], g)
        elif _attr(node, "seed") is not None:
            b.add(x[0], b.op("DropoutGrad", [g, node.output[1], b.const(ratio)], MS))
        else:
            raise TritonCodegenError(
                f"node {node.name or op}: Dropout without a seed cannot be recomputed for its gradient"
            )
    else:
        raise TritonCodegenError(
            f"node {node.name or op}: no gradient rule for {domain or 'ai.onnx'}::{op} in the "
            "Triton verification route"
        )


def gradient_model(forward: onnx.ModelProto) -> GradientModel:
    """The gradient subgraph of ``forward`` (see the module docstring)."""
    graph = forward.graph
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    init_names = set(consts)
    types: dict[str, tuple[int, int]] = {}
    inferred = onnx.shape_inference.infer_shapes(forward, strict_mode=False)
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        t = vi.type.tensor_type
        types[vi.name] = (t.elem_type, len(t.shape.dim) if t.HasField("shape") else -1)
    inputs = [vi for vi in graph.input if vi.name not in init_names]
    rank = max(len(vi.type.tensor_type.shape.dim) for vi in inputs)
    nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in graph.node]
    for node in nodes:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 3:
                node.output.append("")
            for slot, hint in ((1, "mean"), (2, "inv_std")):
                if not node.output[slot]:
                    node.output[slot] = f"{node.output[0]}.{hint}"
    b = _Builder(types={name: t for name, (t, _r) in types.items()}, opset=model_opset(forward))
    grad_inputs = []
    for vi in graph.output:
        gname = f"grad.{vi.name}"
        b.add(vi.name, gname)
        t = vi.type.tensor_type
        grad_inputs.append(
            onnx.helper.make_tensor_value_info(gname, t.elem_type, [None] * len(t.shape.dim))
        )
        if t.elem_type not in FLOAT_TYPES:
            raise TritonCodegenError(f"output {vi.name!r} is not floating point")
    for node in reversed(nodes):
        gs = []
        for o in node.output:
            gs.append(b.total(o) if o and types.get(o, (TP.FLOAT, 0))[0] in FLOAT_TYPES else None)
        _vjp(b, node, gs, consts)
    outputs = []
    wrt = []
    for index, vi in enumerate(inputs):
        elem = vi.type.tensor_type.elem_type
        if elem not in FLOAT_TYPES:
            continue
        total = b.total(vi.name)
        if total is None:
            continue
        out = f"grad_input_{index}"
        b.nodes.append(onnx.helper.make_node("Identity", [total], [out]))
        own_rank = len(vi.type.tensor_type.shape.dim)
        out_rank = own_rank if total in b.reduced else rank
        outputs.append(onnx.helper.make_tensor_value_info(out, elem, [None] * out_rank))
        wrt.append(index)
    if not outputs:
        raise TritonCodegenError("the subgraph has no floating-point input to differentiate")
    initializers = list(graph.initializer) + [
        onnx.numpy_helper.from_array(np.array(v, dtype=np.float32), n)
        for v, n in b.constants.items()
    ]
    g = onnx.helper.make_graph(
        nodes + b.nodes,
        "triton_subgraph_grad",
        list(inputs) + grad_inputs,
        outputs,
        initializer=initializers,
    )
    opsets = {o.domain: o.version for o in forward.opset_import}
    opsets.setdefault(MS, 1)
    model = onnx.helper.make_model(
        g, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    )
    model.ir_version = forward.ir_version
    return GradientModel(model, wrt)
