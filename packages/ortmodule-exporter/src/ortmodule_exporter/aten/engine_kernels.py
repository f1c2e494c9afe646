"""Which ONNX operators the CPU engine has a kernel for at given input types, asked of the engine.

The engine's kernel registry is not listed by ``_pybind_state`` (1.19.2 has no
``get_all_opkernel_def``). So each (operator, opset, input types) is asked once per process: a
one-node model with inputs of those types goes into a CPU inference session with the graph
optimizations off, and only the engine's own answer "Could not find an implementation" counts
as no (a few milliseconds). Any other failure of the probe (a model the ONNX checker refuses)
counts as yes, so a wrong guess never rewrites a node the engine runs.

>>> from ortmodule_exporter.aten.engine_kernels import cpu_kernel_exists
>>> import onnx
>>> u8, i64 = onnx.TensorProto.UINT8, onnx.TensorProto.INT64
>>> cpu_kernel_exists("Equal", (u8, u8)), cpu_kernel_exists("Equal", (i64, i64))
(False, True)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import onnx
import onnx.helper

from ..engine_binding import import_onnxruntime

__all__ = ["cpu_kernel_exists"]

_NO_KERNEL = "Could not find an implementation"
_LOCK = threading.Lock()
_ANSWERS: dict[tuple[str, str, int, tuple[int, ...], tuple[int, ...]], bool] = {}
#: the newest IR version the 1.19 engine loads
_IR_VERSION = 8


def _probe(
    op_type: str, domain: str, opset: int, inputs: Sequence[int], outputs: Sequence[int]
) -> bool:
    ort = import_onnxruntime()
    h = onnx.helper
    names = [f"x{i}" for i in range(len(inputs))]
    outs = [f"y{i}" for i in range(len(outputs))]
    graph = h.make_graph(
        [h.make_node(op_type, names, outs, domain=domain)],
        "kernel_probe",
        [h.make_tensor_value_info(n, t, None) for n, t in zip(names, inputs, strict=True)],
        [h.make_tensor_value_info(n, t, None) for n, t in zip(outs, outputs, strict=True)],
    )
    imports = [h.make_opsetid("", opset)]
    if domain:
        imports.append(h.make_opsetid(domain, 1))
    model = h.make_model(graph, opset_imports=imports)
    model.ir_version = _IR_VERSION
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - the engine's answer is in the message
        return _NO_KERNEL not in str(err)
    return True


def cpu_kernel_exists(
    op_type: str,
    inputs: Sequence[int],
    outputs: Sequence[int] | None = None,
    domain: str = "",
    opset: int = 18,
) -> bool:
    """Whether the CPU engine runs ``domain::op_type`` on inputs of the ONNX element types
    ``inputs`` (its outputs' types ``outputs``, by default the first input's) (asked once)."""
    outs = tuple(outputs) if outputs is not None else (inputs[0],)
    key = (domain, op_type, opset, tuple(inputs), outs)
    with _LOCK:
        answer = _ANSWERS.get(key)
        if answer is None:
            answer = _probe(op_type, domain, opset, inputs, outs)
            _ANSWERS[key] = answer
        return answer
