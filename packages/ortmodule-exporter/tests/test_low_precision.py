"""The CPU engine's low-precision kernels, as :mod:`ortmodule_exporter.aten.low_precision`
assumes them, and the built-graph pass that computes the engine's own low-precision gradient
sums as PyTorch does (:mod:`ortmodule_exporter.passes.low_precision_sums`)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortmodule_exporter.aten.low_precision import CPU_KERNELS
from ortmodule_exporter.engine_binding import import_onnxruntime
from ortmodule_exporter.passes.low_precision_sums import compute_in_float32

ort = import_onnxruntime()
I64 = TensorProto.INT64
MS = "com.microsoft"
DTYPES = {"BFloat16": TensorProto.BFLOAT16, "Half": TensorProto.FLOAT16}


def _run(op: str, kinds: list[int | str], feeds: list[np.ndarray], dtype: int, **kw) -> str:
    """Run one node whose ``"x"`` inputs have ``dtype`` (fed as float32, cast in the graph):
    "ran", "no kernel", or the run's error."""
    nodes, inputs, names = [], [], []
    for i, kind in enumerate(kinds):
        if kind == "x":
            inputs.append(helper.make_tensor_value_info(f"in{i}", TensorProto.FLOAT, None))
            nodes.append(helper.make_node("Cast", [f"in{i}"], [f"x{i}"], to=dtype))
            names.append(f"x{i}")
        else:
            inputs.append(helper.make_tensor_value_info(f"in{i}", kind, None))
            names.append(f"in{i}")
    outs = [f"y{j}" for j in range(kw.pop("outputs", 1))]
    domain = kw.pop("domain", "")
    nodes.append(helper.make_node(op, names, outs, domain=domain, **kw))
    # a float32 copy of each output, which numpy can fetch
    nodes += [helper.make_node("Cast", [o], [f"{o}f"], to=TensorProto.FLOAT) for o in outs]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_value_info(f"{o}f", onnx.TypeProto()) for o in outs]
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
    except Exception as err:  # noqa: BLE001 - the message says which
        if "NOT_IMPLEMENTED" in str(err):
            return "no kernel"
        raise
    try:
        session.run(None, {f"in{i}": f for i, f in enumerate(feeds)})
    except Exception as err:  # noqa: BLE001
        return str(err)
    return "ran"


X = np.arange(24, dtype=np.float32).reshape(4, 6)
_I = lambda *v: np.array(v, np.int64)  # noqa: E731
#: how each operator the engine keeps at low precision is run: inputs, feeds, attributes
_CALLS = {
    "Cast": (["x"], [X], {"to": TensorProto.FLOAT}),
    "Flatten": (["x"], [X], {}),
    "Identity": (["x"], [X], {}),
    "Reshape": (["x", I64], [X, _I(6, 4)], {}),
    "Shape": (["x"], [X], {}),
    "Split": (["x"], [X], {"axis": 0, "outputs": 2}),
    "Squeeze": (["x", I64], [X.reshape(1, 4, 6), _I(0)], {}),
    "Transpose": (["x"], [X], {}),
    "Unsqueeze": (["x", I64], [X, _I(0)], {}),
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(CPU_KERNELS["BFloat16"] - {"Constant"}))
def test_every_operator_kept_on_the_engine_runs_at_that_dtype(op: str, dtype: str) -> None:
    assert op in CPU_KERNELS[dtype]
    kinds, feeds, attrs = _CALLS[op]
    assert _run(op, kinds, feeds, DTYPES[dtype], **attrs) == "ran"


@pytest.mark.parametrize(
    ("op", "kinds", "feeds", "attrs"),
    [
        ("Add", ["x", "x"], [X, X], {}),
        ("MatMul", ["x", "x"], [X, X.T.copy()], {}),
        ("Softmax", ["x"], [X], {}),
        ("Sum", ["x", "x"], [X, X], {}),
    ],
)
def test_bfloat16_arithmetic_has_no_cpu_kernel(op, kinds, feeds, attrs) -> None:
    """Why every operator that computes on bfloat16 is routed to PyTorch."""
    assert _run(op, kinds, feeds, TensorProto.BFLOAT16, **attrs) == "no kernel"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_concat_and_slice_gradients_refuse_low_precision(dtype: str) -> None:
    """Why Concat and Slice are routed though they run forward: their gradient kernels fail."""
    split = _run(
        "SplitTraining", ["x", I64], [X, _I(2, 2)], DTYPES[dtype], axis=0, outputs=2, domain=MS
    )
    assert "does not support" in split
    sliced = _run(
        "SliceGrad", ["x", I64, I64, I64], [X[:2], _I(4, 6), _I(0), _I(2)], DTYPES[dtype], domain=MS
    )
    assert "not supported" in sliced


def _sum_model(terms: int, dtype: int = TensorProto.BFLOAT16) -> onnx.ModelProto:
    """float32 inputs cast to ``dtype`` (exactly: they hold bfloat16 values), summed, cast back;
    the pass learns the Sum's dtype from the Casts."""
    inputs = [helper.make_tensor_value_info(f"in{i}", TensorProto.FLOAT, [5]) for i in range(terms)]
    nodes = [helper.make_node("Cast", [f"in{i}"], [f"g{i}"], to=dtype) for i in range(terms)]
    nodes.append(helper.make_node("Sum", [f"g{i}" for i in range(terms)], ["total"], name="acc"))
    nodes.append(helper.make_node("Cast", ["total"], ["out"], to=TensorProto.FLOAT))
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [5])
    graph = helper.make_graph(nodes, "g", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_bfloat16_sum_becomes_additions_rounded_as_pytorch_rounds_them() -> None:
    model = _sum_model(3)
    assert compute_in_float32(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "Sum" not in ops and ops.count("Add") == 2  # one at a time, as autograd accumulates
    # 1 + 2**-8 is a tie that bfloat16 (7 stored bits) rounds down to 1, twice; summed in
    # float32 first, 1 + 2**-7 is a bfloat16 number
    gen = torch.Generator().manual_seed(0)
    terms = [torch.randn(5, generator=gen).to(torch.bfloat16) for _ in range(3)]
    terms[0][0], terms[1][0], terms[2][0] = 1.0, 2.0**-8, 2.0**-8
    want = ((terms[0] + terms[1]) + terms[2]).float()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {f"in{i}": t.float().numpy() for i, t in enumerate(terms)})
    assert torch.equal(torch.from_numpy(got), want)
    # one float32 sum rounded once is not what eager computes: the test can tell them apart
    assert not torch.equal(sum(t.float() for t in terms).to(torch.bfloat16).float(), want)


def test_float32_sums_are_left_alone() -> None:
    assert compute_in_float32(_sum_model(3, TensorProto.FLOAT)) == 0
