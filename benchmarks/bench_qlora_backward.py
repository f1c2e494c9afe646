"""The input gradient of one 4-bit layer on the CPU engine, three ways, as ONNX graphs.

``dA = dY @ W`` for an NF4 weight ``W [N, K]`` (block 64), ``dY [M, N]``:

- the engine's own gradient node, ``MatMulBnb4(dY, B, transB=0)`` (wrong on CPU: the kernel
  ignores ``transB``; timed for scale);
- ``ortmodule_qlora``'s rewrite: dequantize with ONNX operators, then ``MatMul``;
- the identity rewrite: ``Transpose(MatMulBnb4(I_K, B, transB=1))``, then ``MatMul``.

Each is checked against bitsandbytes' ``dY @ dequantize_4bit(B)``.

    python benchmarks/bench_qlora_backward.py
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import onnx
import onnx.helper as h
import onnx.numpy_helper


def _model(
    nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], m: int, n: int, k: int
) -> onnx.ModelProto:
    graph = h.make_graph(
        nodes,
        "backward",
        [h.make_tensor_value_info("dY", onnx.TensorProto.FLOAT, [m, n])],
        [h.make_tensor_value_info("dA", onnx.TensorProto.FLOAT, [m, k])],
        inits,
    )
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 9  # the engine reads IR <= 10
    return model


def run(quick: bool = True) -> dict[str, Any]:
    import bitsandbytes.functional as F
    import torch

    from ortmodule_exporter.engine import import_onnxruntime
    from ortmodule_qlora.backward_rewrite import rewrite_matmul_bnb4_backward

    ort = import_onnxruntime()
    n = k = 1024 if quick else 4096
    m, block, repeats = 256, 64, 15
    q, state = F.quantize_4bit(torch.randn(n, k), blocksize=block, quant_type="nf4")
    inits = [
        onnx.numpy_helper.from_array(q.view(-1).numpy(), "B"),
        onnx.numpy_helper.from_array(state.absmax.numpy(), "absmax"),
    ]
    attrs = {"K": k, "N": n, "block_size": block, "quant_type": 1, "training_mode": 1}

    def engine_node() -> onnx.NodeProto:
        return h.make_node(
            "MatMulBnb4",
            ["dY", "B", "absmax"],
            ["dA"],
            domain="com.microsoft",
            name="grad",
            transB=0,
            **attrs,
        )

    native = _model([engine_node()], inits, m, n, k)
    ours = _model([engine_node()], inits, m, n, k)
    rewrite_matmul_bnb4_backward(ours)
    identity = _model(
        [
            h.make_node(
                "MatMulBnb4",
                ["I", "B", "absmax"],
                ["WT"],
                domain="com.microsoft",
                transB=1,
                **attrs,
            ),
            h.make_node("Transpose", ["WT"], ["W"]),
            h.make_node("MatMul", ["dY", "W"], ["dA"]),
        ],
        [*inits, onnx.numpy_helper.from_array(np.eye(k, dtype=np.float32), "I")],
        m,
        n,
        k,
    )
    dy = np.random.default_rng(0).standard_normal((m, n), dtype=np.float32)
    want = (torch.from_numpy(dy) @ F.dequantize_4bit(q, state)).numpy()
    options = ort.SessionOptions()
    results: dict[str, Any] = {"shape": {"M": m, "N": n, "K": k, "block": block}}
    for name, model in (
        ("engine_transB0", native),
        ("dequantize_matmul", ours),
        ("identity_matmulbnb4", identity),
    ):
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        out = session.run(None, {"dY": dy})[0]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(None, {"dY": dy})
            times.append(time.perf_counter() - start)
        results[name] = {
            "median_ms": statistics.median(times) * 1e3,
            "max_abs_err_vs_bnb": float(np.abs(out - want).max()),
        }
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
