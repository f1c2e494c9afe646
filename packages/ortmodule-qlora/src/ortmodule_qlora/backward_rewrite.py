"""Give ``MatMulBnb4``'s input gradient correct numbers on the engine's CPU kernel.

The engine's gradient builder writes ``dA = MatMulBnb4(dY, B, absmax, transB=0)``. Its CPU
kernel ignores ``transB`` and always multiplies by the transposed weight, so on CPU that node
computes ``dY @ W.T`` read with the wrong shape (the input gradient differs from eager by up to
hundreds). This built-graph pass replaces each such node with what bitsandbytes' own backward
computes, ``dA = dY @ dequantize(B)``: the 4-bit codes are unpacked (element ``2i`` in the high
nibble, ``2i+1`` in the low one), looked up in the NF4/FP4 table, scaled by their block's absmax
and reshaped to ``W [N, K]``, all with plain ONNX operators, then one ``MatMul``.

Cost: unpacking is O(N*K), what the native kernel does internally before its GEMM. The other
exact rewrite, ``Transpose(MatMulBnb4(I_K, B, transB=1))``, recovers ``W`` through a K x K x N
GEMM with an identity, far more work for every layer. The rewrite runs on every built graph,
CUDA included: the pass cannot see which device a session will place the node on, and the CPU
kernel of the CUDA build ignores ``transB`` too.

>>> from ortmodule_exporter.passes.built_graph import register_built_graph_pass
>>> register_built_graph_pass("qlora_matmul_bnb4_backward", rewrite_matmul_bnb4_backward)
"""

from __future__ import annotations

from typing import Any

import onnx
import onnx.helper as h
import onnx.numpy_helper
import torch

__all__ = ["code_table", "rewrite_matmul_bnb4_backward"]

_DOMAIN = "com.microsoft"
_QUANT_NAMES = {0: "fp4", 1: "nf4"}


def code_table(quant_type: int) -> torch.Tensor:
    """bitsandbytes' 16 code values for ``quant_type`` (0 FP4, 1 NF4), float32 on CPU."""
    import bitsandbytes.functional as F

    name = _QUANT_NAMES.get(quant_type)
    if name is None:
        raise ValueError(f"MatMulBnb4 quant_type {quant_type} is neither 0 (FP4) nor 1 (NF4)")
    table: torch.Tensor = F.get_4bit_type(name, device="cpu")  # type: ignore[no-untyped-call]
    return table.detach().float().cpu()


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: h.get_attribute_value(a) for a in node.attribute}


def _const(name: str, array: Any) -> onnx.NodeProto:
    return h.make_node(
        "Constant", [], [name], name=name, value=onnx.numpy_helper.from_array(array, name)
    )


def _dequantize_and_matmul(node: onnx.NodeProto, attrs: dict[str, Any]) -> list[onnx.NodeProto]:
    import numpy as np

    grad_y, packed, absmax = node.input[0], node.input[1], node.input[2]
    n, k, block = int(attrs["N"]), int(attrs["K"]), int(attrs["block_size"])
    table = code_table(int(attrs.get("quant_type", 1))).numpy()
    p = f"{node.name}/dequantize"
    blocks = -(-n * k // block)

    def v(s: str) -> str:
        return f"{p}/{s}"

    return [
        _const(v("sixteen"), np.array(16, dtype=np.int32)),
        _const(v("last_axis"), np.array([-1], dtype=np.int64)),
        _const(v("flat"), np.array([-1], dtype=np.int64)),
        _const(v("start"), np.array([0], dtype=np.int64)),
        _const(v("count"), np.array([n * k], dtype=np.int64)),
        _const(v("table"), table),
        _const(v("block_shape"), np.array([blocks, 1], dtype=np.int64)),
        _const(v("blocks_full"), np.array([blocks, block], dtype=np.int64)),
        _const(v("weight_shape"), np.array([n, k], dtype=np.int64)),
        h.make_node("Cast", [packed], [v("bytes")], to=onnx.TensorProto.INT32),
        # element 2i sits in the high nibble, 2i+1 in the low one
        h.make_node("Div", [v("bytes"), v("sixteen")], [v("high")]),
        h.make_node("Mod", [v("bytes"), v("sixteen")], [v("low")]),
        h.make_node("Unsqueeze", [v("high"), v("last_axis")], [v("high_1")]),
        h.make_node("Unsqueeze", [v("low"), v("last_axis")], [v("low_1")]),
        h.make_node("Concat", [v("high_1"), v("low_1")], [v("pairs")], axis=-1),
        h.make_node("Reshape", [v("pairs"), v("flat")], [v("codes_padded")]),
        h.make_node("Slice", [v("codes_padded"), v("start"), v("count")], [v("codes")]),
        h.make_node("Gather", [v("table"), v("codes")], [v("values")], axis=0),
        h.make_node("Cast", [absmax], [v("absmax_f32")], to=onnx.TensorProto.FLOAT),
        h.make_node("Reshape", [v("absmax_f32"), v("block_shape")], [v("absmax_col")]),
        h.make_node("Expand", [v("absmax_col"), v("blocks_full")], [v("scales_full")]),
        h.make_node("Reshape", [v("scales_full"), v("flat")], [v("scales_padded")]),
        h.make_node("Slice", [v("scales_padded"), v("start"), v("count")], [v("scales")]),
        h.make_node("Mul", [v("values"), v("scales")], [v("weight_flat")]),
        h.make_node("Reshape", [v("weight_flat"), v("weight_shape")], [v("weight_f32")]),
        h.make_node("CastLike", [v("weight_f32"), grad_y], [v("weight")]),
        h.make_node("MatMul", [grad_y, v("weight")], list(node.output), name=f"{node.name}/MatMul"),
    ]


def rewrite_matmul_bnb4_backward(model: onnx.ModelProto, _config: Any = None) -> bool:
    """Replace every ``MatMulBnb4`` with ``transB=0`` by dequantize + ``MatMul``; True if any."""
    graph = model.graph
    new_nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        if node.domain == _DOMAIN and node.op_type == "MatMulBnb4":
            attrs = _attrs(node)
            if int(attrs.get("transB", 1)) == 0:
                new_nodes.extend(_dequantize_and_matmul(node, attrs))
                changed = True
                continue
        new_nodes.append(node)
    if changed:
        del graph.node[:]
        graph.node.extend(new_nodes)
    return changed
