"""Matrix products on PyTorch's ``mm`` where it measured faster (a built-graph pass).

At GPT-2 124M's sizes the matrix products are 80 % of the engine's step, and which library
multiplies faster depends on the CPU: on a 2-core Xeon with AVX-512 PyTorch's products took
0.5-0.8x the engine's time (the LM head's weight gradient 255 against 505 ms), on a 2-core AMD
EPYC each side won some shapes. So every float32 product of the built graph with a 2-d second
operand (``Gemm``; ``MatMul`` and ``FusedMatMul`` of an activation by a weight, forward and
backward) becomes an ATen node (``_ortmodule_matmul``) where
:func:`~ortmodule_exporter.aten.kernel_choice.matmul_route` times PyTorch's side faster for its
shape class.

A 2-d ``Transpose`` feeding such a product, or taking its only output, is folded into the
node's transpose flags, as the session's own ``MatmulTransposeFusion`` and
``GemmTransposeFusion`` would fold it into the engine's node (the LM head's tied weight is read
through one, its gradient leaves through another: 154 MB copies each). A ``Transpose`` left
with no reader is removed.

Under the recompute levels (``ORTMODULE_KERNEL_CHOICE`` resolved to ``losses``) the forward
half's products stay the engine's, since the engine's memory optimizer recomputes only its own
nodes; the backward half's are still measured. ``ORTMODULE_KERNEL_CHOICE=engine`` keeps every
product on the engine; graphs built for CUDA keep them (the timing is a CPU one).

The products are equal up to float rounding: the two libraries sum in different orders.

>>> from ortmodule_exporter.passes.matmul_routes import route_matmuls
>>> route_matmuls(model, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.kernel_choice import MATMUL, current_mode, matmul_overload, matmul_route
from ..onnx_graph import attribute, producers_and_consumers, value_shapes
from .built_graph import register_built_graph_pass

__all__ = ["route_matmuls", "routes_products"]

_MS = "com.microsoft"
_YIELD = "YieldOp"
_FLOAT = onnx.TensorProto.FLOAT

Shapes = dict[str, tuple[int, list[int | None] | None]]


@dataclass
class _Product:
    """One product node read as ``alpha * op(A) @ op(B) + beta * C``."""

    a: str
    b: str
    c: str
    trans_a: bool
    trans_b: bool
    alpha: float
    beta: float
    fused: bool  # the engine runs it as FusedMatMul (MatMul, FusedMatMul), else Gemm


def _read(node: onnx.NodeProto) -> _Product | None:
    """The product ``node`` computes, or None for a node the pass leaves alone. A ``MatMul``
    has none of the attributes read: their defaults are its product."""
    onnx_domain = node.domain in ("", "ai.onnx")
    gemm = node.op_type == "Gemm" and onnx_domain
    fused = node.op_type == "FusedMatMul" and node.domain == _MS
    if not (gemm or fused or (node.op_type == "MatMul" and onnx_domain)):
        return None
    if fused and (attribute(node, "transBatchA", 0) or attribute(node, "transBatchB", 0)):
        return None
    c = node.input[2] if gemm and len(node.input) > 2 else ""
    return _Product(
        node.input[0],
        node.input[1],
        c,
        bool(attribute(node, "transA", 0)),
        bool(attribute(node, "transB", 0)),
        float(attribute(node, "alpha", 1.0)),
        float(attribute(node, "beta", 1.0)) if c else 0.0,
        fused=not gemm,
    )


def _float32(shapes: Shapes, names: list[str]) -> bool:
    """Some of ``names`` is known float32 and none is known as another type."""
    types = [shapes[n][0] for n in names if n in shapes]
    return bool(types) and all(t == _FLOAT for t in types)


def _rank(shapes: Shapes, name: str) -> int | None:
    dims = shapes.get(name, (0, None))[1]
    return None if dims is None else len(dims)


def _dims(shapes: Shapes, name: str, rank: int) -> list[int | None]:
    dims = shapes.get(name, (0, None))[1]
    return list(dims) if dims is not None and len(dims) == rank else [None] * rank


class _Transposes:
    """The graph's 2-d ``Transpose`` nodes (``perm=[1, 0]``) by output, and who reads what."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        producers, self.readers = producers_and_consumers(graph)
        self.producer = {
            name: node
            for name, node in producers.items()
            if node.op_type == "Transpose"
            and node.domain in ("", "ai.onnx")
            and list(attribute(node, "perm", [])) == [1, 0]
        }

    def source(self, name: str) -> str | None:
        """What ``name`` is the transpose of, when a 2-d ``Transpose`` makes it."""
        node = self.producer.get(name)
        return node.input[0] if node is not None else None

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        """The 2-d ``Transpose`` that is the only reader of ``name``, if there is one."""
        readers = self.readers.get(name, [])
        if len(readers) == 1 and self.producer.get(readers[0].output[0]) is readers[0]:
            return readers[0]
        return None


def route_matmuls(model: onnx.ModelProto, device_type: str) -> int:
    """Rewrite the float32 products the kernel choice runs on PyTorch; returns how many."""
    if device_type != "cpu" or current_mode() == "engine":
        return 0
    graph = model.graph
    shapes = value_shapes(graph)
    outputs = {vi.name for vi in graph.output}
    transposes = _Transposes(graph)
    nodes = list(graph.node)
    split = next((i for i, n in enumerate(nodes) if n.op_type == _YIELD), len(nodes))
    replaced: dict[int, onnx.NodeProto] = {}
    removed: set[int] = set()
    for position, node in enumerate(nodes):
        product = _read(node)
        if product is None or len(node.output) != 1:
            continue
        rewritten = _route(product, node, shapes, transposes, outputs, position > split)
        if rewritten is None:
            continue
        new, absorbed = rewritten
        replaced[position] = new
        if absorbed is not None:
            removed.add(id(absorbed))
    if not replaced:
        return 0
    # the engine infers no type for an ATen node's output: each gets its value_info
    typed = {vi.name for vi in (*graph.value_info, *graph.output)}
    for new in replaced.values():
        if new.output[0] not in typed:
            graph.value_info.append(onnx.helper.make_tensor_value_info(new.output[0], _FLOAT, None))
    kept = [replaced.get(i, n) for i, n in enumerate(nodes) if id(n) not in removed]
    kept = _without_dead_transposes(kept, outputs, set(transposes.producer))
    del graph.node[:]
    graph.node.extend(kept)
    return len(replaced)


def _route(
    product: _Product,
    node: onnx.NodeProto,
    shapes: Shapes,
    transposes: _Transposes,
    outputs: set[str],
    backward: bool,
) -> tuple[onnx.NodeProto, onnx.NodeProto | None] | None:
    """The ATen node for ``product`` and the output ``Transpose`` it absorbs, or None when the
    product stays the engine's."""
    a, b, trans_a, trans_b = product.a, product.b, product.trans_a, product.trans_b
    # operands made by a 2-d Transpose are read as they were, with the flag turned
    source_a, source_b = transposes.source(a), transposes.source(b)
    if source_b is not None:
        b, trans_b = source_b, not trans_b
    if source_a is not None:
        a, trans_a = source_a, not trans_a
    out = node.output[0]
    if not _float32(shapes, [product.a, product.b, a, b, out]):
        return None
    # Gemm's operands are matrices by definition; a MatMul's B must be known to be one
    if product.fused and _rank(shapes, b) != 2:
        return None
    rank_a = _rank(shapes, a) if product.fused else 2
    if rank_a is None:
        if trans_a:
            return None
        # a MatMul's A of another rank is multiplied as torch.matmul does (ONNX's MatMul is
        # numpy's, and so is torch.matmul): 0, unknown
        rank_a = 0
    if rank_a == 1 or (rank_a > 2 and trans_a):
        return None
    # op(A) is m x k, op(B) k x n; a dim no value fixes stays None (the batch's rows)
    dims_a = _dims(shapes, a, rank_a) if rank_a else [None, None]
    dims_b = _dims(shapes, b, 2)
    dims_out = _dims(shapes, out, rank_a) if rank_a else [None, None]
    m = ((dims_a[1] if trans_a else dims_a[0]) or dims_out[0]) if rank_a == 2 else None
    k = (dims_b[1] if trans_b else dims_b[0]) or (dims_a[0] if trans_a else dims_a[-1])
    n = (dims_b[0] if trans_b else dims_b[1]) or dims_out[-1]
    # an output read only by a 2-d Transpose: computed transposed, (AB)^T = B^T A^T
    after = transposes.only_reader(out)
    if after is None or product.c or rank_a != 2 or out in outputs:
        after = None
    else:
        a, b, trans_a, trans_b = b, a, not trans_b, not trans_a
        m, n = n, m
        out = after.output[0]
    bias = bool(product.c)
    if (
        matmul_route(m, k, n, trans_a, trans_b, bias=bias, fused=product.fused, backward=backward)
        != "torch"
    ):
        return None
    if after is not None:
        # its output is now the ATen node's: no later product may read through it
        del transposes.producer[out]
    new = onnx.helper.make_node(
        "ATen",
        [a, b] + ([product.c] if bias else []),
        [out],
        name=f"{node.name}_matmul",
        domain=ATEN_DOMAIN,
        operator=MATMUL,
        overload_name=matmul_overload(
            trans_a, trans_b, product.alpha, product.beta, graph_output=out in outputs
        ),
    )
    return new, after


def _without_dead_transposes(
    nodes: list[onnx.NodeProto], outputs: set[str], transposed: set[str]
) -> list[onnx.NodeProto]:
    """``nodes`` without the 2-d ``Transpose`` nodes nothing reads any more."""
    read = {name for node in nodes for name in node.input} | outputs
    return [
        n
        for n in nodes
        if not (n.op_type == "Transpose" and n.output[0] in transposed and n.output[0] not in read)
    ]


def routes_products(model_bytes: bytes) -> bool:
    """Whether a serialized built model holds products this pass gave PyTorch (the operator's
    name is written nowhere else in a model: read from the bytes, without parsing them)."""
    return MATMUL.encode() in model_bytes


def _pass(model: onnx.ModelProto, config: Any) -> bool:
    return route_matmuls(model, config.device_type) > 0


register_built_graph_pass("matmul_routes", _pass, order=62)
