"""One benchmark configuration in one fresh process; ``python -m benchmarks`` starts these.

    python -m benchmarks.worker train --model gpt --mode ortmodule --out r.json
    python -m benchmarks.worker train --model gpt --mode ortmodule --profile /tmp/prof --out r.json
    python -m benchmarks.worker overhead --mode eager --out r.json
    python -m benchmarks.worker micro --name bench_pytree --out r.json
    python -m benchmarks.worker ratio --model gpt --modes eager ortmodule --out r.json
    python -m benchmarks.worker ratio --model gpt --modes eager eager-bf16 ortmodule-bf16 --out r.json

Each writes one JSON object to ``--out``. A failure inside the measured code (``torch.compile``
on a machine without a working compiler, an export error) is written as ``{"error": ...}``
instead of crashing, so the report can show it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import inspect
import itertools
import json
import os
import pstats
import resource
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .models import TINY, WORKLOADS, Workload
from .stats import median_interval

#: ``<mode>-bf16``: the same mode with forward and loss under ``torch.autocast("cpu", torch.bfloat16)``
#: (backward and the optimizer outside it, as the autocast docs prescribe); fp32 weights
AUTOCAST_SUFFIX = "-bf16"
#: ``eager-checkpoint``: eager with Hugging Face's ``gradient_checkpointing_enable()`` (the
#: recompute levels' eager counterpart; Hugging Face models only); ``ortmodule-level1``/``2``:
#: ORTModule at that recompute level (``DebugOptions(memory_opt_level=...)``, so that it can
#: take turns with the other modes in one process)
MODES = (
    "eager",
    "compile",
    "ortmodule",
    "eager-bf16",
    "compile-bf16",
    "ortmodule-bf16",
    "eager-checkpoint",
    "ortmodule-level1",
    "ortmodule-level2",
)
_LEVEL = "ortmodule-level"


def forward_context(mode: str) -> contextlib.AbstractContextManager[Any]:
    """What the forward (and the loss) of ``mode`` runs under: bfloat16 autocast for ``*-bf16``."""
    if mode.endswith(AUTOCAST_SUFFIX):
        return torch.autocast("cpu", torch.bfloat16)
    return contextlib.nullcontext()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    # kilobytes on Linux: the high-water mark of this fresh process
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RssSampler:
    """The largest resident set seen while it runs, read from ``/proc/self/statm`` every
    ``interval`` seconds by a daemon thread: the peak of the later steps, which ``ru_maxrss``
    (the process's high-water mark, the graph build included) cannot give. A spike shorter than
    the interval can be missed."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak_mib = _rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_mib = max(self.peak_mib, _rss_mib())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, _rss_mib())
        return self.peak_mib


def _error_text(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    head = lines[0] if lines else ""
    if "[ONNXRuntimeError]" in head:
        # the engine's own words come after its source location, which fills the first 300
        before, _, after = head.partition(": /onnxruntime_src/")
        head = f"{before}: [ONNXRuntimeError]{after.split('[ONNXRuntimeError]', 1)[-1]}"
    return f"{type(err).__name__}: {head}"[:300]


class _TimedAgent:
    """Stands in for the engine's ``TrainingAgent`` and times its two calls (engine time)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.seconds = 0.0
        self.calls = 0

    def _timed(self, call: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def run_forward(self, *args: Any) -> Any:
        return self._timed(self.agent.run_forward, *args)

    def run_backward(self, *args: Any) -> Any:
        return self._timed(self.agent.run_backward, *args)


def timed_step(
    model: Any, optimizer: Any, workload: Workload, batch: Any, mode: str = "eager"
) -> tuple[float, float, float]:
    """One training step on ``batch``: seconds of forward + backward, seconds of the optimizer
    step + ``zero_grad`` + ``loss.item()``, and the loss. The forward and the loss run under
    :func:`forward_context` of ``mode``."""
    args, kwargs = batch
    start = time.perf_counter()
    with forward_context(mode):
        loss = workload.loss(model(*args, **kwargs), batch)
    loss.backward()
    mid = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()
    return mid - start, time.perf_counter() - mid, value


def kernel_events(profile_file: str) -> Iterator[tuple[str, str, float]]:
    """(node name, op type, microseconds) of every kernel run in the engine's Chrome-trace
    profile, in order."""
    with open(profile_file) as f:
        events = json.load(f)
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "Node" and name.endswith("_kernel_time"):
            yield name, e.get("args", {}).get("op_name", "?"), float(e.get("dur", 0))


def _training_session(model: Any) -> Any:
    """The engine session ORTModule built for training (``TrainingSession``)."""
    graph = model._runner.transitions.current(True, True)
    if graph is None:
        raise RuntimeError("ORTModule has not built a training graph")
    return graph.session


def _time_engine_calls(model: Any) -> _TimedAgent:
    """Put a :class:`_TimedAgent` between ORTModule's training session and the engine's agent."""
    session = _training_session(model)
    agent = _TimedAgent(session._agent)
    session._agent = agent
    return agent


def _enable_engine_profiling(prefix: str) -> None:
    """Turn on ONNX Runtime's profiler for every session this process creates.

    The engine boundary (``ortmodule_exporter.engine._session``) builds its ``SessionOptions``
    from ``onnxruntime.SessionOptions()``; this benchmark-only process hands it options with
    profiling on. The measured runs never do this.
    """
    from ortmodule_exporter.engine_binding import import_onnxruntime

    onnxruntime = import_onnxruntime()
    original = onnxruntime.SessionOptions
    sessions = itertools.count()

    def profiling_options() -> Any:
        options = original()
        options.enable_profiling = True
        # one prefix per session: the engine names its file by the second it started, and a
        # kernel-choice timing session started in the same second as the training session
        # wrote into the training session's file (its SoftmaxCrossEntropyLoss showed up there)
        options.profile_file_prefix = f"{prefix}_{next(sessions)}"
        return options

    onnxruntime.SessionOptions = profiling_options


def _top_operators(profile_file: str, steps: int, top: int = 12) -> dict[str, Any]:
    """Kernel time per operator type from the engine's Chrome-trace profile."""
    by_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for _name, op, us in kernel_events(profile_file):
        by_op[op] += us
        count[op] += 1
    total = sum(by_op.values())
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1])
    return {
        "kernel_us_per_step": total / max(steps, 1),
        "operators": [
            {
                "op": op,
                "us_per_step": us / max(steps, 1),
                "share": us / total if total else 0.0,
                "nodes_per_step": count[op] / max(steps, 1),
            }
            for op, us in ranked[:top]
        ],
    }


def _wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    mode = mode.removesuffix(AUTOCAST_SUFFIX)
    if mode == "compile":
        return torch.compile(model)  # type: ignore[return-value]
    if mode == "eager-checkpoint":
        # Hugging Face's activation checkpointing, non-reentrant (PyTorch's recommended form)
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        return model
    if mode == "ortmodule" or mode.startswith(_LEVEL):
        from ortmodule import DebugOptions, ORTModule

        # timings of a PyTorch fallback would be reported as ORTModule's: every failure stops
        os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
        leveled = mode.startswith(_LEVEL)
        level = DebugOptions(memory_opt_level=int(mode.removeprefix(_LEVEL))) if leveled else None
        return ORTModule(model, level)
    return model


def train(
    workload: Workload,
    mode: str,
    full: bool,
    profile: str | None,
    steps: tuple[int, int] | None,
    sample_rss: bool = False,
) -> dict[str, Any]:
    """Warmup, then measured steps of forward + backward + AdamW; times, losses, memory.

    ``peak_rss_first_step_mib`` is the process's high-water mark after the first step (the
    model, and for ORTModule the export, graph build and session); with ``sample_rss`` a
    :class:`RssSampler` gives the peak of the later steps alone (``peak_rss_steps_mib``)."""
    warmup, measured = steps or workload.steps(full)
    batches = [workload.batch(i, full) for i in range(warmup + measured)]
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "model": workload.name,
        "mode": mode,
        "warmup": warmup,
        "measured": measured,
    }
    if profile:
        _enable_engine_profiling(profile)
    try:
        base = workload.build(full)
    except Exception as err:  # e.g. transformers missing: an error row, not a crash
        result["error"] = f"building the model failed: {_error_text(err)}"
        result["traceback"] = traceback.format_exc()[-3000:]
        return result
    result["parameters"] = sum(p.numel() for p in base.parameters())
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)
    result["rss_before_mib"] = _rss_mib()
    seconds: list[float] = []
    optimizer_seconds: list[float] = []
    losses: list[float] = []
    agent: _TimedAgent | None = None
    sampler: RssSampler | None = None
    engine_before = 0.0
    try:
        model = _wrap(base, mode)
        model.train()
        for step, batch in enumerate(batches):
            fwd_bwd, optimizer_s, loss = timed_step(model, optimizer, workload, batch, mode)
            losses.append(loss)
            seconds.append(fwd_bwd + optimizer_s)
            optimizer_seconds.append(optimizer_s)
            if step == 0:
                result["peak_rss_first_step_mib"] = _peak_rss_mib()
                if sample_rss:
                    sampler = RssSampler()
            if mode.startswith("ortmodule") and agent is None:
                agent = _time_engine_calls(model)
            if agent is not None and step == warmup - 1:
                engine_before = agent.seconds
    except Exception as err:  # reported in the table, not raised
        result["error"] = _error_text(err)
        result["traceback"] = traceback.format_exc()[-3000:]
    if sampler is not None:
        peak = sampler.stop()
        if len(seconds) > 1:  # a one-step run (the warm start) has no later steps
            result["peak_rss_steps_mib"] = peak
    result["step_seconds"] = seconds
    result["losses"] = losses
    result["peak_rss_mib"] = _peak_rss_mib()
    if seconds:
        result["first_step_s"] = seconds[0]
    if len(seconds) > warmup:
        result["median_step_s"] = statistics.median(seconds[warmup:])
        result["median_optimizer_s"] = statistics.median(optimizer_seconds[warmup:])
        # means add up (step = engine + optimizer + the rest), medians do not
        result["mean_step_s"] = statistics.fmean(seconds[warmup:])
        result["mean_optimizer_s"] = statistics.fmean(optimizer_seconds[warmup:])
    if mode.startswith("ortmodule") and "error" not in result:
        times = getattr(model._runner, "last_times", None)
        result["phases"] = dict(times.seconds) if times is not None else {}
        result["exports"] = model._runner.exports
        result["calibrations"] = _calibrations()
        if agent is not None and measured:
            result["engine_s_per_step"] = (agent.seconds - engine_before) / measured
        if profile:
            engine = _training_session(model)._session
            result["profile_file"] = engine.end_profiling()
            result["profile"] = _top_operators(result["profile_file"], warmup + measured)
    return result


def _calibrations() -> list[dict[str, Any]]:
    """The kernel-choice calibrations this process ran (or took from the export cache)."""
    from ortmodule_exporter.aten import kernel_choice

    return [
        {
            "op": op,
            "dtype": dtype,
            "size": str(size),
            "route": route,
            "seconds": kernel_choice.calibration_seconds().get((op, dtype, size), 0.0),
        }
        for (op, dtype, size), (route, _engine_us, _torch_us) in kernel_choice.decisions().items()
    ]


def ratio(
    workload: Workload,
    modes: list[str],
    full: bool,
    rounds: int,
    steps: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Step-time ratios to eager, the modes taking turns one step each in this one process.

    A busy machine slows every mode of a round alike, so the median of the per-round ratios is
    far steadier than ratios of medians from separate processes (the load moves between them).
    """
    warmup, measured = steps or workload.steps(full)
    measured = max(measured, rounds)
    batches = [workload.batch(i, full) for i in range(warmup + measured)]
    result: dict[str, Any] = {"model": workload.name, "modes": modes, "rounds": measured}
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    try:
        for mode in modes:
            base = workload.build(full)
            runs[mode] = (_wrap(base, mode), torch.optim.AdamW(base.parameters(), lr=1e-3))
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        losses: dict[str, list[float]] = {mode: [] for mode in modes}
        for step, (args, kwargs) in enumerate(batches):
            # a different mode first each round, so none always runs right after another
            order = modes[step % len(modes) :] + modes[: step % len(modes)]
            for mode in order:
                fwd_bwd, optimizer_s, loss = timed_step(*runs[mode], workload, (args, kwargs), mode)
                losses[mode].append(loss)
                seconds[mode].append(fwd_bwd + optimizer_s)
    except Exception as err:  # reported, not raised
        result["error"] = _error_text(err)
        result["traceback"] = traceback.format_exc()[-3000:]
        return result
    result["median_step_s"] = {m: statistics.median(seconds[m][warmup:]) for m in modes}
    per_round = {
        m: [a / b for a, b in zip(seconds[m][warmup:], seconds[modes[0]][warmup:], strict=True)]
        for m in modes
    }
    result["ratio"] = {m: statistics.median(r) for m, r in per_round.items()}
    result["round_ratios"] = per_round
    # (low, high, coverage) of the median ratio: how sure "at or below 1.0x" is (stats.py)
    result["interval"] = {m: median_interval(r) for m, r in per_round.items()}
    result["max_loss_diff"] = {
        m: max(abs(a - b) for a, b in zip(losses[m], losses[modes[0]], strict=True)) for m in modes
    }
    # the same against every other mode of the run: ORTModule under autocast against eager
    # under autocast is the comparison that matters for the *-bf16 modes
    result["vs"] = {}
    for base in modes[1:]:
        rounds = {
            m: [a / b for a, b in zip(seconds[m][warmup:], seconds[base][warmup:], strict=True)]
            for m in modes
            if m != base
        }
        result["vs"][base] = {
            "ratio": {m: statistics.median(r) for m, r in rounds.items()},
            "interval": {m: median_interval(r) for m, r in rounds.items()},
            "max_loss_diff": {
                m: max(abs(a - b) for a, b in zip(losses[m], losses[base], strict=True))
                for m in rounds
            },
        }
    return result


def overhead(mode: str, full: bool) -> dict[str, Any]:
    """Per-step time of forward + backward on a tiny model: the framework's own work."""
    warmup, measured = TINY.steps(full)
    batches = [TINY.batch(i, full) for i in range(warmup + measured)]
    model = _wrap(TINY.build(full), mode)
    seconds = []
    agent: _TimedAgent | None = None
    engine_before = 0.0
    for step, (args, kwargs) in enumerate(batches):
        start = time.perf_counter()
        TINY.loss(model(*args, **kwargs), (args, kwargs)).backward()
        seconds.append(time.perf_counter() - start)
        if mode == "ortmodule" and agent is None:
            agent = _time_engine_calls(model)
        if agent is not None and step == warmup - 1:
            engine_before = agent.seconds
    result: dict[str, Any] = {
        "mode": mode,
        "measured": measured,
        "median_us": statistics.median(seconds[warmup:]) * 1e6,
        "mean_us": statistics.fmean(seconds[warmup:]) * 1e6,
    }
    if agent is not None:
        result["engine_us"] = (agent.seconds - engine_before) / measured * 1e6
    # where the Python time goes: a cProfile of further steps (relative numbers: profiling slows)
    profiler = cProfile.Profile()
    profiled = min(measured, 200)
    args, kwargs = batches[-1]
    profiler.enable()
    for _ in range(profiled):
        TINY.loss(model(*args, **kwargs), (args, kwargs)).backward()
    profiler.disable()
    stats = pstats.Stats(profiler)
    shares: dict[str, float] = defaultdict(float)
    ours: list[tuple[float, str]] = []
    for (filename, line, func), (_cc, _calls, tottime, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        shares[_category(filename, func)] += tottime
        if "ortmodule" in filename:
            ours.append((tottime, f"{_short_path(filename)}:{line}({func})"))
    total = sum(shares.values()) or 1.0
    result["cprofile_categories"] = {
        k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
    }
    ours.sort(reverse=True)
    result["cprofile_ours"] = [{"function": name, "share": t / total} for t, name in ours[:8]]
    return result


#: cProfile rows -> where the per-step time goes (first match wins)
_CATEGORIES = (
    ("TrainingAgent", "engine: run_forward + run_backward (C++)"),
    ("ortmodule_pytree", "ortmodule_pytree: flatten / unflatten"),
    ("dlpack", "DLPack hand-over (to_dlpack, from_dlpack, OrtValueVector)"),
    ("OrtValueVector", "DLPack hand-over (to_dlpack, from_dlpack, OrtValueVector)"),
    ("ortmodule_exporter", "ortmodule_exporter: engine boundary (feeds, outputs)"),
    ("ortmodule/", "ortmodule runtime: forward, autograd bridge, bookkeeping"),
    ("benchmarks", "engine: run_forward + run_backward (C++)"),
    ("torch/autograd", "torch autograd (backward driver, Function.apply)"),
    ("_EngineBase", "torch autograd (backward driver, Function.apply)"),
)


def _category(filename: str, func: str) -> str:
    where = f"{filename} {func}".replace("\\", "/")
    for needle, name in _CATEGORIES:
        if needle in where:
            return name
    return "other (torch operators of the loss, Python builtins)"


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    for i, part in enumerate(parts):
        if part.startswith("ortmodule"):
            return "/".join(parts[i:])
    return Path(filename).name


def micro(name: str, full: bool) -> dict[str, Any]:
    """Run ``benchmarks/<name>.py``'s ``run()``: ``run(quick=...)`` where it takes ``quick``."""
    module = importlib.import_module(f"benchmarks.{name}")
    run = getattr(module, "run", None)
    if run is None:
        return {"name": name, "skipped": f"benchmarks/{name}.py has no run() function"}
    doc = (inspect.getdoc(module) or "").split("\n\n")[0].replace("\n", " ")
    returns = (inspect.getdoc(run) or "").split("\n\n")[0].replace("\n", " ")
    if returns:
        doc = f"{doc} `run()`: {returns}" if doc else returns
    start = time.perf_counter()
    try:
        if "quick" in inspect.signature(run).parameters:
            value = run(quick=not full)
        else:
            value = run()
    except Exception as err:  # reported, not raised
        return {
            "name": name,
            "doc": doc,
            "error": _error_text(err),
            "traceback": traceback.format_exc()[-3000:],
        }
    return {"name": name, "doc": doc, "result": value, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train")
    t.add_argument("--model", choices=sorted(WORKLOADS), required=True)
    t.add_argument("--mode", choices=MODES, required=True)
    t.add_argument("--profile", help="file prefix: profile the engine (ortmodule mode)")
    t.add_argument("--steps", type=int, nargs=2, metavar=("WARMUP", "MEASURED"))
    t.add_argument(
        "--sample-rss",
        action="store_true",
        help="sample the resident set during the later steps (their own peak)",
    )
    o = sub.add_parser("overhead")
    o.add_argument("--mode", choices=("eager", "ortmodule"), required=True)
    m = sub.add_parser("micro")
    m.add_argument("--name", required=True)
    r = sub.add_parser("ratio")
    r.add_argument("--model", choices=sorted(WORKLOADS), required=True)
    r.add_argument("--modes", nargs="+", choices=MODES, default=["eager", "ortmodule"])
    r.add_argument("--rounds", type=int, default=0, help="measured rounds (default: the model's)")
    r.add_argument("--steps", type=int, nargs=2, metavar=("WARMUP", "MEASURED"))
    for p in (t, o, m, r):
        p.add_argument("--full", action="store_true")
        p.add_argument(
            "--threads", type=int, help="torch.set_num_threads (the engine uses as many)"
        )
        p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "train":
        steps = tuple(args.steps) if args.steps else None
        result = train(
            WORKLOADS[args.model],
            args.mode,
            args.full,
            args.profile,
            steps,  # type: ignore[arg-type]
            sample_rss=args.sample_rss,
        )
    elif args.what == "overhead":
        result = overhead(args.mode, args.full)
    elif args.what == "ratio":
        modes = ["eager", *(m for m in args.modes if m != "eager")]
        steps = tuple(args.steps) if args.steps else None
        result = ratio(WORKLOADS[args.model], modes, args.full, args.rounds, steps)  # type: ignore[arg-type]
    else:
        result = micro(args.name, args.full)
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
