"""One timing run, in a process of its own: ``python -m ortmodule_testing.frontends.timing gpt 30``.

Trains the zoo case ``gpt`` for 30 SGD steps in eager, then under ORTModule (fallback disabled,
the frontend the environment names), and prints one JSON line: ORTModule's first-step phases
(export, graph build, session creation, from its phase timer), the first step's and the median
later step's wall time, eager's median step, and, under ``torch_export``, how long importing
onnxscript took (done before the first step, so that step does not include it: it is paid once
per process, at the first export).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from typing import Any

import torch


def _step_times(model: torch.nn.Module, name: str, steps: int) -> list[float]:
    from ortmodule_testing.zoo import ZOO

    case = ZOO[name]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = []
    for step in range(steps):
        args, kwargs = case.make_batch(step)
        start = time.perf_counter()
        loss = case.loss_fn(model(*args, **kwargs), args, kwargs)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(name: str, steps: int) -> dict[str, Any]:
    """The timings of zoo case ``name`` (see the module docstring)."""
    from ortmodule_testing.zoo import ZOO

    frontend = os.environ.get("ORTMODULE_EXPORTER", "torchscript") or "torchscript"
    result: dict[str, Any] = {"model": name, "frontend": frontend, "steps": steps}
    if frontend == "torch_export":
        start = time.perf_counter()
        importlib.import_module("onnxscript")

        result["onnxscript_import_s"] = round(time.perf_counter() - start, 4)
    from ortmodule import ORTModule

    case = ZOO[name]
    eager = _step_times(case.build(seed=0), name, steps)
    wrapped = ORTModule(case.build(seed=0))
    ours = _step_times(wrapped, name, steps)
    runner: Any = wrapped._runner  # noqa: SLF001 - the phase timer of the first step
    phases = dict(runner.last_times.seconds) if runner.last_times is not None else {}
    result.update(
        {
            "export_s": round(phases.get("export", float("nan")), 4),
            "graph_build_s": round(phases.get("graph build", float("nan")), 4),
            "session_creation_s": round(phases.get("session creation", float("nan")), 4),
            "first_step_s": round(ours[0], 4),
            "median_step_s": round(statistics.median(ours[1:]), 6),
            "eager_median_step_s": round(statistics.median(eager[1:]), 6),
            "builds": int(runner.transitions.builds),
        }
    )
    return result


def main(argv: list[str]) -> int:
    # one thread: on a shared machine, spinning worker threads of either library make the
    # times noise (and the engine's threads follow torch's)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(json.dumps(measure(argv[0], int(argv[1]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
