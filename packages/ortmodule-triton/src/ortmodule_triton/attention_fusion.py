"""``ORTMODULE_USE_FLASH_ATTENTION=1``: attention in the exported graph -> one flash-attention op.

The patterns (what ``torch.nn.functional.scaled_dot_product_attention`` and hand-written Hugging
Face attention export to, on 4-D ``[batch, heads, seq, head_dim]`` tensors)::

    MatMul(Q, Kt) -> Mul(., scale) | Div(., d) -> [Where(mask, ., -big) | Add(., bias)]
      -> Softmax(axis=-1) -> [IsNaN -> Where(isnan, 0, .)] -> MatMul(., V)

become ``Transpose(Kt)`` and a PythonOp running :class:`FlashAttentionOp` (the Triton kernels of
:mod:`ortmodule_triton.flash_attention`, forward and backward). Intermediate results must have no
other reader (attention probabilities returned to the user keep the pattern unfused). Through a
PythonOp the same rewrite works in the CPU engine (interpreted, for tests) and the CUDA engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch

from ortmodule_exporter.onnx_graph import constant_values
from ortmodule_exporter.python_op import PYTHON_OP_DOMAIN, REGISTRY, python_op_node
from ortmodule_exporter.python_op import runner as python_op_runner

from .flash_attention import FlashAttentionFunction
from .flash_attention import _forward as flash_forward
from .partition import _types, topological_sort

__all__ = ["AttentionMatch", "FlashAttentionOp", "find_attention", "fuse_attention"]


class FlashAttentionOp(torch.autograd.Function):
    """``(q, k, v, scale_tensor, divide, [mask]) -> out``: the PythonOp's Function.

    ``divide`` is 1 when the graph divides the scores by the tensor instead of multiplying.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                divide: int, mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        value = float(scale.reshape(()).item())
        value = 1.0 / value if divide else value
        out, lse = flash_forward(q, k, v, value, mask)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.scale = value
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        dq, dk, dv, _, _ = FlashAttentionFunction.backward(ctx, grad_out)
        return dq, dk, dv, None, None, None


@dataclass(frozen=True)
class AttentionMatch:
    nodes: tuple[int, ...]
    q: str
    kt: str
    v: str
    scale: str
    divide: bool
    mask: str | None
    out: str


def _consumers(graph: onnx.GraphProto) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for k, n in enumerate(graph.node):
        for i in n.input:
            found.setdefault(i, []).append(k)
    return found


def find_attention(model: onnx.ModelProto) -> list[AttentionMatch]:
    """Every attention pattern of ``model``'s graph (see the module docstring)."""
    graph = model.graph
    producer = {o: k for k, n in enumerate(graph.node) for o in n.output}
    consumers = _consumers(graph)
    outputs = {o.name for o in graph.output}
    consts = constant_values(model.graph)
    types = _types(model)

    def node(name: str) -> tuple[int, onnx.NodeProto] | None:
        k = producer.get(name)
        return None if k is None else (k, graph.node[k])

    def only_reader(name: str, k: int) -> bool:
        return name not in outputs and consumers.get(name, []) == [k]

    def rank(name: str) -> int | None:
        dims = types.get(name, (0, None))[1]
        return None if dims is None else len(dims)

    def scores_side(name: str) -> bool:
        """``name`` is Q @ Kt, maybe scaled by a Mul or Div."""
        got = node(name)
        if got is None:
            return False
        if got[1].op_type == "MatMul":
            return True
        if got[1].op_type in ("Mul", "Div"):
            return any(
                (p := node(i)) is not None and p[1].op_type == "MatMul" for i in got[1].input
            )
        return False

    found: list[AttentionMatch] = []
    for ks, softmax in enumerate(graph.node):
        if softmax.op_type != "Softmax" or softmax.domain not in ("", "ai.onnx"):
            continue
        axis = next((a.i for a in softmax.attribute if a.name == "axis"), -1)
        if axis not in (-1, 3) or rank(softmax.input[0]) != 4:
            continue
        members = [ks]
        x = softmax.input[0]
        mask: str | None = None
        got = node(x)
        if got is None or not only_reader(x, ks):
            continue
        k_mask, n_mask = got
        if n_mask.op_type == "Where" and n_mask.input[2] in consts:
            if float(np.max(consts[n_mask.input[2]])) > -1e4:
                continue  # not a masking fill
            mask, x = n_mask.input[0], n_mask.input[1]
            members.append(k_mask)
        elif n_mask.op_type == "Add":
            a, b = n_mask.input
            sides = [scores_side(a), scores_side(b)]
            if sides.count(True) != 1:
                continue  # neither or both look like scores: not this pattern
            x, mask = (a, b) if sides[0] else (b, a)
            members.append(k_mask)
        if x != softmax.input[0] and not only_reader(x, members[-1]):
            continue
        got = node(x)
        if got is None:
            continue
        k_scale, n_scale = got
        divide = False
        if n_scale.op_type in ("Mul", "Div"):
            a, b = n_scale.input
            pa = node(a)
            if n_scale.op_type == "Mul" and (pa is None or pa[1].op_type != "MatMul"):
                a, b = b, a
            scale, scores = b, a
            divide = n_scale.op_type == "Div"
            members.append(k_scale)
            if not only_reader(scores, k_scale):
                continue
        elif n_scale.op_type == "MatMul":
            scale, scores = "", x
        else:
            continue
        if rank(scale) not in (None, 0, 1) and scale:
            continue
        got = node(scores)
        if got is None or got[1].op_type != "MatMul":
            continue
        k_mm1, mm1 = got
        members.append(k_mm1)
        q, kt = mm1.input
        # output side: [IsNaN -> Where(isnan, 0, p)] -> MatMul(p, V)
        probs = softmax.output[0]
        readers = consumers.get(probs, [])
        if probs in outputs:
            continue
        if len(readers) == 2:
            kinds = {graph.node[r].op_type: r for r in readers}
            if set(kinds) != {"IsNaN", "Where"}:
                continue
            k_nan, k_where = kinds["IsNaN"], kinds["Where"]
            where = graph.node[k_where]
            if where.input[2] != probs or where.input[0] != graph.node[k_nan].output[0]:
                continue
            if not only_reader(graph.node[k_nan].output[0], k_where):
                continue
            members += [k_nan, k_where]
            probs = where.output[0]
            readers = consumers.get(probs, [])
            if probs in outputs:
                continue
        if len(readers) != 1 or graph.node[readers[0]].op_type != "MatMul":
            continue
        k_mm2 = readers[0]
        mm2 = graph.node[k_mm2]
        if mm2.input[0] != probs:
            continue
        members.append(k_mm2)
        if any(rank(t) != 4 for t in (q, kt, mm2.input[1])):
            continue
        if mask is not None and rank(mask) is None:
            continue
        found.append(
            AttentionMatch(
                tuple(sorted(members)), q, kt, mm2.input[1], scale, divide, mask, mm2.output[0]
            )
        )
    return found


def fuse_attention(model: onnx.ModelProto, training: bool) -> int:
    """Rewrite every matched attention into a flash-attention PythonOp; returns how many."""
    matches = find_attention(model)
    if not matches:
        return 0
    python_op_runner.install()
    entry = REGISTRY.register(FlashAttentionOp)
    graph = model.graph
    elem = _types(model)
    drop = {k for m in matches for k in m.nodes}
    added: list[onnx.NodeProto] = []
    for index, m in enumerate(matches):
        tag = f"FlashAttention_{index}"
        k_name = f"{tag}.k"
        added.append(onnx.helper.make_node("Transpose", [m.kt], [k_name], perm=[0, 1, 3, 2]))
        scale = m.scale
        if not scale:
            scale = f"{tag}.one"
            added.append(
                onnx.helper.make_node(
                    "Constant", [], [scale],
                    value=onnx.numpy_helper.from_array(np.array(1.0, dtype=np.float32)),
                )
            )  # fmt: skip
        inputs = [m.q, k_name, m.v, scale]
        dtype = elem.get(m.q, (onnx.TensorProto.FLOAT, None))[0]
        scale_type = elem.get(scale, (onnx.TensorProto.FLOAT, None))[0]
        scale_rank = len(elem.get(scale, (0, []))[1] or [])
        types_in = [dtype, dtype, dtype, scale_type]
        ranks_in = [4, 4, 4, scale_rank]
        convention = "ddddc"
        if m.mask is not None:
            mask_type, mask_dims = elem[m.mask]
            inputs.append(m.mask)
            types_in.append(mask_type)
            ranks_in.append(len(mask_dims or []))
            convention += "d"
            if mask_type == onnx.TensorProto.BOOL:
                entry.bool_inputs.add(5)
        added.append(
            python_op_node(
                entry,
                inputs,
                [f"{tag}.ctx", m.out],
                name=tag,
                convention=convention,
                types=(types_in, [dtype]),
                ranks=(ranks_in, [4]),
                training=training,
                scalars={"int": ([int(m.divide)], [4])},
                comment="flash attention",
            )
        )
    kept = [n for k, n in enumerate(graph.node) if k not in drop]
    del graph.node[:]
    graph.node.extend(kept + added)
    topological_sort(graph)
    if not any(o.domain == PYTHON_OP_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(PYTHON_OP_DOMAIN, 1))
    return len(matches)
