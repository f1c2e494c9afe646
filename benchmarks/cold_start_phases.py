"""The parts of ORTModule's cold first step on GPT-2 small, timed in one process.

``python -m benchmarks.cold_start_phases`` (from the repository root) builds the
``gpt2_124m`` workload (GPT2LMHeadModel at GPT-2 small's config, batch 4 x 256, one thread;
``--threads N`` for N), runs one ORTModule forward and backward with an empty export cache and
prints one JSON line:
the runtime's own phases (export, graph build, session creation), the first step, and timers
put around the export's parts (the trace, torch.onnx's lowering and its whole-graph shape
inference, the size guards' symbolic shape inference, the kernel-choice calibrations). The
timers wrap functions by name, so a part that a later version no longer calls reads 0. With
``--eager`` the same process times eager's first forward and backward instead (the goal's
reference, "eager's first step + 5 s"), so both are measured by the same code.
Results: ``results/2026-11-27-cold-start-amd-epyc-2c.md``,
``results/2026-11-28-calibration-steady-state-amd-epyc-2c.md``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from .models import GPT2_BATCH, GPT2_SMALL, causal_lm_batch, gpt2_model

SECONDS: dict[str, float] = {}


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] = SECONDS.get(label, 0.0) + time.perf_counter() - start

    return timed


def _wrap(owner: Any, name: str, label: str) -> None:
    if hasattr(owner, name):
        setattr(owner, name, _timed(label, getattr(owner, name)))


def _first_step(
    wrap: Callable[[torch.nn.Module], torch.nn.Module], forward_label: str
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The workload's model, wrapped by ``wrap``, after one timed forward and backward."""
    torch.manual_seed(0)
    model = wrap(gpt2_model())
    model.train()
    _, batch = causal_lm_batch(GPT2_SMALL["vocab_size"], GPT2_BATCH)(0, False)
    load = os.getloadavg()
    start = time.perf_counter()
    out = model(**batch)
    forward = time.perf_counter()
    out.loss.backward()
    end = time.perf_counter()
    return model, {
        "first step": end - start,
        forward_label: forward - start,
        "backward": end - forward,
        "loss": out.loss.item(),
        "load": [load, os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="PyTorch's intra-op threads")
    parser.add_argument("--eager", action="store_true", help="time eager's first step instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.eager:
        _, step = _first_step(lambda m: m, "forward")
        print(json.dumps({"mode": "eager", **step, "threads": args.threads}))
        return
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    os.environ["ORTMODULE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ortmodule-cold-")
    # before the exporter wraps any of them: its wrappers then sit outside these timers
    _wrap(torch._C, "_create_graph_by_tracing", "trace (a real forward)")
    _wrap(torch._C, "_jit_pass_onnx", "lowering: symbolics (incl. calibrations)")
    _wrap(torch._C, "_jit_pass_onnx_graph_shape_type_inference", "lowering: graph shape inference")
    _wrap(torch.onnx, "export", "torch.onnx.export")
    exporter = importlib.import_module("ortmodule_exporter.export.exporter")
    shape_guards = importlib.import_module("ortmodule_exporter.export.shape_guards")
    onnx_graph = importlib.import_module("ortmodule_exporter.onnx_graph")
    _wrap(exporter, "copy_for_export", "deep copy of the module")
    _wrap(exporter, "_keep_guards", "guards (all)")
    _wrap(shape_guards, "_symbolic_value_infos", "guards: ORT symbolic shape inference")
    _wrap(onnx_graph, "output_dependencies", "output_dependencies")

    from ortmodule import ORTModule
    from ortmodule_exporter.aten import kernel_choice

    model, step = _first_step(ORTModule, "forward (export, build, session, engine forward)")
    times = model._runner.last_times  # type: ignore[union-attr]
    result = {
        "mode": "ortmodule",
        **step,
        **(dict(times.seconds) if times is not None else {}),
        **SECONDS,
        "calibrations": sum(kernel_choice.calibration_seconds().values()),
        "each calibration": {
            str(k): round(v, 3) for k, v in kernel_choice.calibration_seconds().items()
        },
        "threads": args.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
