"""Generated Triton kernels against torch on realistic transformer shapes (CUDA only).

Each case is one fused subgraph as ORTModule's partition finds it in a GPT/BERT layer: bias +
erf GELU, residual Add + LayerNorm, scaled masked Softmax, and flash attention against torch's
``scaled_dot_product_attention``. The ratio is the generated kernel's median time over torch's
(eager, one op at a time) in the same process; below 1 is faster.

    python benchmarks/bench_triton.py

On a machine without CUDA it says so and exits: the interpreter's timings mean nothing.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import numpy as np
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper


def _model(nodes, inputs, outputs, inits=()):  # type: ignore[no-untyped-def]
    g = h.make_graph(
        nodes,
        "bench",
        [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [h.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        initializer=list(inits),
    )
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _scalar(name: str, value: float):  # type: ignore[no-untyped-def]
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


def _time(fn: Callable[[], object], repeat: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_triton: needs a CUDA device (CPU runs the interpreter: timings mean nothing)")
        return 0
    from ortmodule_triton import compile_subgraph
    from ortmodule_triton.flash_attention import flash_attention

    dev, rows, hidden, ffn = "cuda", 8 * 512, 768, 3072
    F = T.FLOAT
    gelu = compile_subgraph(
        _model(
            [
                h.make_node("Add", ["x", "b"], ["s"]),
                h.make_node("Div", ["s", "sqrt2"], ["d"]),
                h.make_node("Erf", ["d"], ["e"]),
                h.make_node("Add", ["e", "one"], ["p"]),
                h.make_node("Mul", ["s", "p"], ["q"]),
                h.make_node("Mul", ["q", "half"], ["y"]),
            ],
            [("x", F, ["n", ffn]), ("b", F, [ffn])],
            [("y", F, ["n", ffn])],
            [_scalar("sqrt2", 2**0.5), _scalar("one", 1.0), _scalar("half", 0.5)],
        )
    )
    ln = compile_subgraph(
        _model(
            [
                h.make_node("Add", ["x", "r"], ["s"]),
                h.make_node("LayerNormalization", ["s", "w", "b"], ["y"], axis=-1),
            ],
            [
                ("x", F, ["n", hidden]),
                ("r", F, ["n", hidden]),
                ("w", F, [hidden]),
                ("b", F, [hidden]),
            ],
            [("y", F, ["n", hidden])],
        )
    )
    x, b = torch.randn(rows, ffn, device=dev), torch.randn(ffn, device=dev)
    xh, r = torch.randn(rows, hidden, device=dev), torch.randn(rows, hidden, device=dev)
    w, bb = torch.randn(hidden, device=dev), torch.randn(hidden, device=dev)
    q, k, v = (torch.randn(8, 12, 512, 64, device=dev, dtype=torch.float16) for _ in range(3))
    causal = torch.ones(512, 512, dtype=torch.bool, device=dev).tril()
    cases = [
        (
            "bias + GELU [4096, 3072] fp32",
            lambda: gelu(x, b),
            lambda: torch.nn.functional.gelu(x + b),
        ),
        (
            "residual + LayerNorm [4096, 768] fp32",
            lambda: ln(xh, r, w, bb),
            lambda: torch.nn.functional.layer_norm(xh + r, (hidden,), w, bb),
        ),
        (
            "flash attention fwd [8, 12, 512, 64] fp16 causal",
            lambda: flash_attention(q, k, v, mask=causal),
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        ),
    ]
    print(f"device: {torch.cuda.get_device_name()}")
    print("| case | torch (ms) | generated (ms) | ratio |\n| --- | ---: | ---: | ---: |")
    for name, ours, theirs in cases:
        t_ours, t_torch = _time(ours), _time(theirs)
        print(f"| {name} | {t_torch:.3f} | {t_ours:.3f} | {t_ours / t_torch:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
