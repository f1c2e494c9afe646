"""What keeping a Function's saved tensors safe from the engine costs (issue #13 item 1).

A ``torch.autograd.Function`` that saves its own output, followed by ``sigmoid`` (which the
engine may compute in place over that output), under ORTModule: the runner hands the engine a
copy of the saved output. Measured: the median training step with the copy, and with the copy
disabled (which gives wrong gradients; timing only), plus the bytes copied per step.

    python benchmarks/bench_saved_tensors.py          # quick
    python benchmarks/bench_saved_tensors.py --full
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

BATCH, HIDDEN = 64, 1024


class _ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x) * 1.7
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return gy * (1.7 - y * y / 1.7)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(256, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sigmoid(_ScaledTanh.apply(self.fc1(x))))


def _median_step(protect: bool, repeat: int) -> tuple[float, int]:
    from ortmodule import ORTModule
    from ortmodule_exporter.python_op import runner as python_op_runner

    real = python_op_runner._kept_storages
    if not protect:
        python_op_runner._kept_storages = lambda ctx: set()  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        model = ORTModule(_Net())
        x = torch.randn(BATCH, 256)
        for _ in range(3):
            model(x).sum().backward()
        before = python_op_runner.protective_copies()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            model(x).sum().backward()
            times.append(time.perf_counter() - start)
        copies = (python_op_runner.protective_copies() - before) // repeat
        return statistics.median(times), copies
    finally:
        python_op_runner._kept_storages = real  # type: ignore[assignment]


def run(quick: bool = True) -> dict[str, float]:
    """Median step in ms with and without the copy, and the bytes copied per step."""
    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    repeat = 50 if quick else 500
    with_copy, copies = _median_step(True, repeat)
    without, _ = _median_step(False, repeat)
    return {
        "step ms, saved output copied": with_copy * 1e3,
        "step ms, not copied (wrong gradients)": without * 1e3,
        "bytes copied per step": float(copies * BATCH * HIDDEN * 4),
    }


def main() -> None:
    for name, value in run(quick="--full" not in sys.argv).items():
        print(f"{name}: {value:.3f}" if "ms" in name else f"{name}: {value:.0f}")


if __name__ == "__main__":
    main()
