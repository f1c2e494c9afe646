"""Build one-graph ONNX models and compare a generated kernel with onnx's reference evaluator."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

from ortmodule_triton import compile_subgraph

NP_TYPES = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.BOOL: np.bool_, T.INT64: np.int64}
TORCH_TYPES = {T.FLOAT: torch.float32, T.FLOAT16: torch.float16, T.BFLOAT16: torch.bfloat16}
#: fp32 as the project's default; half precision: the kernel accumulates reductions in fp32 where
#: numpy (the reference) sums in fp16, so they differ by a few fp16 ulps (2**-10 relative)
TOLERANCE = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.float16: {"rtol": 4e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 2e-2},
}


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[tuple[str, int, Sequence[int | str]]],
    outputs: Sequence[tuple[str, int, Sequence[int | str]]],
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    graph = h.make_graph(
        list(nodes),
        "subgraph",
        [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [h.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        initializer=list(initializers),
    )
    return h.make_model(
        graph, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("com.microsoft", 1)]
    )


def check_against_reference(m: onnx.ModelProto, feeds: Sequence[torch.Tensor]) -> None:
    """Run ``m`` through the generated kernel and the reference evaluator; compare every element."""
    kernel = compile_subgraph(m)
    got = kernel(*feeds)
    names = [i.name for i in m.graph.input if i.name not in {t.name for t in m.graph.initializer}]
    # the reference evaluator has no bfloat16: it computes those in float32 (loose tolerance)
    ref_feeds = {
        n: (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        for n, t in zip(names, feeds, strict=True)
    }
    ref_model = m
    if any(t.dtype == torch.bfloat16 for t in feeds):
        ref_model = onnx.ModelProto()
        ref_model.CopyFrom(m)
        for vi in (*ref_model.graph.input, *ref_model.graph.output):
            if vi.type.tensor_type.elem_type == T.BFLOAT16:
                vi.type.tensor_type.elem_type = T.FLOAT
    expected = ReferenceEvaluator(ref_model).run(None, ref_feeds)
    # an fp32 output computed from half-precision inputs is only as close as those inputs allow
    order = [torch.float32, torch.float16, torch.bfloat16]
    widest = max((t.dtype for t in feeds if t.dtype in order), key=order.index, default=None)
    assert len(got) == len(expected)
    for out, want, vi in zip(got, expected, m.graph.output, strict=True):
        want_t = torch.from_numpy(np.asarray(want))
        assert tuple(out.shape) == tuple(want_t.shape), vi.name
        if out.dtype == torch.bool or not out.is_floating_point():
            assert torch.equal(out, want_t.to(out.dtype)), vi.name
        else:
            torch.testing.assert_close(
                out.float(),
                want_t.float(),
                **TOLERANCE[max(out.dtype, widest or out.dtype, key=order.index)],
                msg=lambda m, n=vi.name: f"{n}: {m}",
            )
