"""Where a training step's time goes, eager against ORTModule, kind of kernel by kind of kernel.

    python -m benchmarks.breakdown --model gpt            # a Markdown table on stdout
    python -m benchmarks.breakdown --model cnn --steps 20 --json out.json

One process holds an eager copy and an ORTModule copy of the workload's model (same weights,
same batches) and:

1. times forward + backward and the optimizer step of each, one step of each in turn (the
   interleaved ratio, as ``benchmarks.worker ratio`` measures it);
2. profiles the same number of steps of each: eager under ``torch.profiler`` (the self time of
   every operator outside the optimizer); ORTModule's engine kernels with the engine's profiler
   on, in a third copy used for nothing else (that profiler slows the PyTorch functions the ATen
   nodes run: a cross-entropy backward took 25 ms instead of 0.6), and the PyTorch functions its
   ATen nodes run timed by name, in the unprofiled copy;
3. sorts both into the same kinds (GEMMs, attention, convolution, normalization, activation,
   loss, embedding, everything else) and prints milliseconds per step side by side.

Two **floors** close it, as ratios to eager's profiled step:
- *arithmetic*: only the GEMMs, attention and convolutions (each kind at the faster of the two
  columns) and the optimizer (PyTorch's AdamW in both modes) cost anything. These kinds are
  bound by float32 multiply-adds at the machine's rate; a ratio goal below this floor cannot be
  met with exact float32 kernels on this machine, whatever else gets faster;
- *best of both*: every kind at the faster of the two columns, and the engine's scheduling and
  its hand-over to PyTorch free.

Profilers add their own cost, and the engine's more than PyTorch's: with it on, the engine's
``SoftmaxCrossEntropyLoss`` took 12.9 ms a GPT step, yet swapping it for PyTorch's
cross-entropy (1.5 ms) left the unprofiled step unchanged (1.05x and 1.05x interleaved). Read
the ORTModule column for where the time goes, the timed ratio in (1) for what it costs, and
the line *engine calls, timed around them* (unprofiled) for what the engine's kinds add up to.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .models import WORKLOADS, Workload
from .worker import (
    _enable_engine_profiling,
    _time_engine_calls,
    _training_session,
    kernel_events,
    timed_step,
)

KINDS = (
    "GEMM",
    "attention",
    "convolution",
    "pooling",
    "normalization",
    "activation",
    "loss",
    "embedding",
    "other",
)

#: (substring of a PyTorch operator or engine op type, kind); the first that matches wins
_PATTERNS = (
    ("flash_attention", "attention"),
    ("scaled_dot_product", "attention"),
    ("conv", "convolution"),
    ("pool", "pooling"),
    ("norm", "normalization"),
    ("gelu", "activation"),
    ("relu", "activation"),
    ("silu", "activation"),
    ("threshold_backward", "activation"),
    ("clamp_min", "activation"),
    ("sigmoid", "activation"),
    ("cross_entropy", "loss"),
    ("softmaxcrossentropy", "loss"),
    ("log_softmax", "loss"),
    ("nll_loss", "loss"),
    ("embedding", "embedding"),
    ("gathergrad", "embedding"),
    ("matmul", "GEMM"),
    ("gemm", "GEMM"),
    ("addmm", "GEMM"),
    ("bmm", "GEMM"),
)
_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mm", "addmm", "bmm"}


def kind_of(name: str) -> str:
    """The kind of a PyTorch operator (``aten::mm``, ``_ortmodule_gelu``) or engine op type."""
    if name in _GEMMS:
        return "GEMM"
    low = name.lower()
    for needle, kind in _PATTERNS:
        if needle in low:
            return kind
    return "other"


#: the kinds bound by arithmetic (float32 multiply-adds at the machine's rate), not by memory or
#: by how many operators run
_ARITHMETIC = ("GEMM", "attention", "convolution")


def _eager_kinds(
    model: Any, optimizer: Any, workload: Workload, batches: list[Any]
) -> dict[str, float]:
    """Self time of every operator run outside ``Optimizer.step``, ms per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            timed_step(model, optimizer, workload, batch)
    by_op: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if not event.name.startswith("aten::") and "flash" not in event.name:
            continue
        parent, inside_optimizer = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("Optimizer."):
                inside_optimizer = True
                break
            parent = parent.cpu_parent
        if not inside_optimizer:
            by_op[event.name] += event.self_cpu_time_total / 1e3 / len(batches)
    return by_op


def _timed_aten(times: dict[str, float]) -> Callable[[], None]:
    """Time what ORTModule's ATen nodes run, by operator name; returns the undo."""
    from ortmodule_exporter.aten import executor

    original = executor.execute

    def execute(op_name: str, overload: str, inputs: list[Any]) -> Any:
        start = time.perf_counter()
        try:
            return original(op_name, overload, inputs)
        finally:
            times[op_name] += (time.perf_counter() - start) * 1e3

    executor.execute = execute  # type: ignore[assignment]

    def undo() -> None:
        executor.execute = original  # type: ignore[assignment]

    return undo


def _engine_kinds(profile_file: str, steps: int) -> dict[str, float]:
    """Kernel time per kind of the last ``steps`` runs of every node but the ATen ones, ms per
    step."""
    per_node: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    for name, op, us in kernel_events(profile_file):
        per_node[name].append((op, us))
    by_op: dict[str, float] = collections.defaultdict(float)
    for runs in per_node.values():
        for op, us in runs[-steps:]:
            if op != "ATen":
                by_op[op] += us / 1e3 / steps
    return by_op


@contextlib.contextmanager
def _engine_profiling(prefix: str) -> Iterator[None]:
    """Sessions created inside profile their kernels (``benchmarks.worker``'s patch, undone)."""
    from ortmodule_exporter.engine_binding import import_onnxruntime

    onnxruntime = import_onnxruntime()
    original = onnxruntime.SessionOptions
    _enable_engine_profiling(prefix)
    try:
        yield
    finally:
        onnxruntime.SessionOptions = original


def _by_kind(ops: dict[str, float]) -> dict[str, float]:
    totals = dict.fromkeys(KINDS, 0.0)
    for op, ms in ops.items():
        totals[kind_of(op)] += ms
    return totals


def _top(ops: dict[str, float], n: int = 12) -> list[tuple[str, float]]:
    return sorted(ops.items(), key=lambda kv: -kv[1])[:n]


def run(model: str = "gpt", steps: int = 10, warmup: int = 12) -> dict[str, Any]:
    """Timed and profiled steps of eager and ORTModule, and the floors (see the module doc)."""
    from ortmodule import ORTModule

    workload = WORKLOADS[model]
    batches = [workload.batch(i, False) for i in range(warmup + 2 * steps)]

    def build(wrap: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        base = workload.build(False)
        wrapped = ORTModule(base) if wrap else base
        wrapped.train()
        return wrapped, torch.optim.AdamW(base.parameters(), lr=1e-3)

    with tempfile.TemporaryDirectory() as folder:
        modes = {"eager": build(False), "ortmodule": build(True)}
        # the engine's profiler slows the PyTorch functions its ATen nodes run (a cross-entropy
        # backward took 25 ms instead of 0.6), so a second copy, used for nothing else, has it
        profiled_copy = build(True)
        # the kernel choice measures at the first export: without the profiler (the same first
        # step for eager, so both train on the same weights)
        for pair in modes.values():
            timed_step(*pair, workload, batches[0])
        with _engine_profiling(str(Path(folder) / "breakdown")):
            timed_step(*profiled_copy, workload, batches[0])
        timed: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        losses: dict[str, list[float]] = {m: [] for m in modes}
        for i, batch in enumerate(batches[1 : warmup + steps]):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for mode in order:
                fwd_bwd, opt, loss = timed_step(*modes[mode], workload, batch)
                losses[mode].append(loss)
                if i + 1 >= warmup:
                    timed[mode].append((fwd_bwd, opt))
        profiled = batches[warmup + steps :]
        eager = _eager_kinds(*modes["eager"], workload, profiled)
        aten_ms: dict[str, float] = collections.defaultdict(float)
        agent = _time_engine_calls(modes["ortmodule"][0])
        undo = _timed_aten(aten_ms)
        try:
            for batch in profiled:
                timed_step(*modes["ortmodule"], workload, batch)
        finally:
            undo()
        for batch in batches[1 : warmup + 1] + profiled:
            timed_step(*profiled_copy, workload, batch)
        engine_ops = _engine_kinds(
            _training_session(profiled_copy[0])._session.end_profiling(), len(profiled)
        )
    ours_ops = {**engine_ops, **{f"ATen {op}": ms / len(profiled) for op, ms in aten_ms.items()}}

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    step = {m: ms([a + b for a, b in timed[m]]) for m in modes}
    ratios = [
        (a + b) / (c + d) for (a, b), (c, d) in zip(timed["ortmodule"], timed["eager"], strict=True)
    ]
    optimizer = {m: ms([b for _a, b in timed[m]]) for m in modes}
    kinds = {"eager": _by_kind(eager), "ortmodule": _by_kind(ours_ops)}
    best = {k: min(kinds["eager"][k], kinds["ortmodule"][k]) for k in KINDS}
    profiled_eager = sum(kinds["eager"].values()) + optimizer["eager"]
    arithmetic_ms = optimizer["eager"] + sum(best[k] for k in _ARITHMETIC)
    best_ms = optimizer["eager"] + sum(best.values())
    engine_calls_ms = agent.seconds * 1e3 / len(profiled)
    return {
        "model": model,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "step_ms": step,
        "optimizer_ms": optimizer,
        "ratio": statistics.median(ratios),
        "max_loss_diff": max(
            abs(a - b) for a, b in zip(losses["ortmodule"], losses["eager"], strict=True)
        ),
        "kinds_ms": kinds,
        "engine_calls_ms": engine_calls_ms,
        "top_ms": {"eager": _top(eager), "ortmodule": _top(ours_ops)},
        "profiled_eager_ms": profiled_eager,
        "arithmetic_floor_ms": arithmetic_ms,
        "arithmetic_floor_ratio": arithmetic_ms / profiled_eager,
        "best_of_both_ms": best_ms,
        "best_of_both_ratio": best_ms / profiled_eager,
    }


def markdown(result: dict[str, Any]) -> str:
    kinds = result["kinds_ms"]
    lines = [
        f"### {result['model']}: {result['steps']} steps each, {result['threads']} threads",
        "",
        f"- interleaved step: eager {result['step_ms']['eager']:.1f} ms, ORTModule "
        f"{result['step_ms']['ortmodule']:.1f} ms; ratio **{result['ratio']:.2f}x** "
        f"(max loss diff {result['max_loss_diff']:.1e})",
        f"- optimizer step (PyTorch's AdamW in both): eager {result['optimizer_ms']['eager']:.1f}"
        f" ms, ORTModule {result['optimizer_ms']['ortmodule']:.1f} ms",
        "",
        "| kind | eager (ms/step) | ORTModule (ms/step) |",
        "| --- | ---: | ---: |",
    ]
    for kind in KINDS:
        e, o = kinds["eager"][kind], kinds["ortmodule"][kind]
        if e or o:
            lines.append(f"| {kind} | {e:.1f} | {o:.1f} |")
    lines.append(
        f"| sum (forward + backward) | {sum(kinds['eager'].values()):.1f} | "
        f"{sum(kinds['ortmodule'].values()):.1f} |"
    )
    lines.append(
        f"| ORTModule's engine calls, timed around them | | {result['engine_calls_ms']:.1f} |"
    )
    lines += [
        "",
        f"Floors, against eager's profiled {result['profiled_eager_ms']:.1f} ms (optimizer "
        f"included): GEMMs, attention and convolutions at the faster of the two, the "
        f"optimizer, nothing else: {result['arithmetic_floor_ms']:.1f} ms, "
        f"**{result['arithmetic_floor_ratio']:.2f}x**; every kind at the faster of the two and "
        f"no hand-over: {result['best_of_both_ms']:.1f} ms, "
        f"**{result['best_of_both_ratio']:.2f}x**.",
        "",
    ]
    for mode in ("eager", "ortmodule"):
        top = ", ".join(f"{op} {v:.1f}" for op, v in result["top_ms"][mode][:8])
        lines.append(f"- top operators, {mode} (ms/step): {top}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="gpt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = run(args.model, args.steps, args.warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.write(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
