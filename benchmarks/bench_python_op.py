"""What one PythonOp and one ATen node cost inside the engine, against the op run natively.

A model chains ``K`` times the same tiny elementwise op (``x + 1`` on 64 floats, so the op's own
compute is negligible) and runs under ORTModule three ways: as the ONNX ``Add`` the engine runs
natively, as a ``torch.autograd.Function`` (one PythonOp each) and as an ATen node (PyTorch's
``aten::sub`` with -1, called back by the engine). The per-op cost is the step time of the ``K``-op
model minus the ``0``-op model's, divided by ``K``; eager PyTorch is shown for scale. Forward is
measured in eval mode under ``no_grad`` (the inference graph, where an ATen node goes straight
through the executor); forward+backward in training, where an operator without a gradient
definition runs as a PythonOp (AtenOp) so that autograd provides its backward.

    python benchmarks/bench_python_op.py          # quick
    python benchmarks/bench_python_op.py --full
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

CHAIN = 16
SIZE = 64


class _AddOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Chain(torch.nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor], length: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(SIZE))
        self.op = op
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        for _ in range(self.length):
            h = self.op(h)
        return h


def _native(h: torch.Tensor) -> torch.Tensor:
    return h + 1


def _aten(h: torch.Tensor) -> torch.Tensor:
    return h - -1.0  # aten::sub, routed to an ATen node (the native variant's add is not)


def _median_seconds(step: Callable[[], Any], repeat: int, rounds: int = 3) -> float:
    """The lowest of ``rounds`` medians: the machine's other load only ever adds time."""
    for _ in range(max(3, repeat // 10)):
        step()
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians)


def _step_time(
    op: Callable[[torch.Tensor], torch.Tensor], length: int, train: bool, engine: bool, repeat: int
) -> float:
    from ortmodule import ORTModule
    from ortmodule.custom_autograd import configure

    model: torch.nn.Module = _Chain(op, length)
    if engine:
        wrapped = ORTModule(model)
        configure(wrapped.options)
        model = wrapped
    x = torch.randn(SIZE)
    if train:

        def step() -> None:
            model(x).sum().backward()

    else:
        model.eval()  # the inference graph: ATen nodes run through the executor directly

        def step() -> None:
            with torch.no_grad():
                model(x)

    return _median_seconds(step, repeat)


def run(quick: bool = True) -> dict[str, dict[str, float]]:
    """Microseconds per op: ``{mode: {route: us}}`` for modes forward and forward+backward."""
    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    from ortmodule_exporter.aten import routes as aten_routes

    aten_routes.register_aten_route("aten::sub")
    repeat = 200 if quick else 2000
    routes = {
        "native ONNX op": (_native, True),
        "PythonOp (autograd.Function)": (_AddOne.apply, True),
        "ATen node": (_aten, True),
        "eager PyTorch": (_native, False),
    }
    results: dict[str, dict[str, float]] = {}
    for mode, train in (("forward", False), ("forward+backward", True)):
        row = {}
        for name, (op, engine) in routes.items():
            base = _step_time(op, 0, train, engine, repeat)
            chain = _step_time(op, CHAIN, train, engine, repeat)
            row[name] = max(0.0, (chain - base) / CHAIN * 1e6)
        results[mode] = row
    return results


def main() -> None:
    results = run(quick="--full" not in sys.argv)
    columns = list(next(iter(results.values())))
    print(
        f"Per-op cost in microseconds ({CHAIN} chained `x + 1` on {SIZE} floats, median step time)\n"
    )
    print("| mode | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for mode, row in results.items():
        print(f"| {mode} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
