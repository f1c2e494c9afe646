"""``python -m benchmarks``: ORTModule against PyTorch eager and ``torch.compile``.

Every configuration (model, mode) runs in its own fresh process (``python -m benchmarks.worker``),
so first-step times are cold and peak memory is that configuration's own. The report goes to
``benchmarks/results/<YYYY-MM-DD>-<machine>.md``.

    python -m benchmarks                       # the quick suite: under ten minutes on two cores
    python -m benchmarks --full                # bigger batches, more steps
    python -m benchmarks --models gpt mlp_many_small --modes eager ortmodule --no-micro
    python -m benchmarks --models gpt bert llama --modes eager --bf16 --no-micro --no-overhead
                                               # bfloat16 autocast rows (and fp32 eager)
    python -m benchmarks --scale               # real sizes: GPT-2 124M, a 350M Llama (issue #41)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .models import (
    AUTOCAST_MODELS,
    DEFAULT_MODELS,
    LABEL_SPARSITY_MODELS,
    PADDING_ELIMINATION,
    PADDING_MODELS,
    SCALE_MODELS,
    WORKLOADS,
)
from .report import SCALE_MODES, Report, machine_info, machine_slug, write_report
from .worker import MODES as WORKER_MODES

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
MODES = ("eager", "ortmodule", "compile")
#: with --bf16, per model of AUTOCAST_MODELS: the same modes under torch.autocast("cpu", bfloat16)
AUTOCAST_MODES = ("eager-bf16", "ortmodule-bf16", "compile-bf16")
#: measured rounds of each interleaved run at least: 30 give a 95.7% interval for the median
#: ratio between the 10th and 21st smallest rounds (benchmarks/stats.py), about 20 s per model
INTERLEAVED_ROUNDS = 30


def _micro_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("bench_*.py"))


class Runner:
    """Starts the worker processes and collects their JSON results."""

    def __init__(
        self, full: bool, timeout: float, threads: int | None = None, log: Any = None
    ) -> None:
        self.full = full
        self.extra = (["--full"] if full else []) + (["--threads", str(threads)] if threads else [])
        self.timeout = timeout
        self.commands: list[str] = []
        self.log = log or (lambda text: print(text, flush=True))
        self._tmp = tempfile.TemporaryDirectory(prefix="ortmodule-bench-")
        self.tmp = Path(self._tmp.name)
        self._count = 0

    def close(self) -> None:
        self._tmp.cleanup()

    def run(self, label: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        """One worker process; its result, or ``{"error": ...}`` when it died or timed out."""
        self._count += 1
        out = self.tmp / f"result-{self._count}.json"
        cmd = [sys.executable, "-m", "benchmarks.worker", *args, *self.extra, "--out", str(out)]
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        shown = (
            (shown + " " if shown else "")
            + "python -m benchmarks.worker "
            + " ".join(shlex.quote(a) for a in cmd[3:-2])
        )
        self.commands.append(shown)
        full_env = {k: v for k, v in os.environ.items() if k not in ("ORTMODULE_CACHE_DIR",)}
        full_env.update(env or {})
        start = time.perf_counter()
        try:
            done = subprocess.run(
                cmd,
                cwd=ROOT,
                env=full_env,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            result: dict[str, Any] = {"error": f"timed out after {self.timeout:.0f} s"}
        else:
            if done.returncode == 0 and out.exists():
                result = json.loads(out.read_text())
            else:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                result = {
                    "error": f"the process exited with code {done.returncode}: {tail[0][:300]}"
                }
        wall = time.perf_counter() - start
        result["process_wall_s"] = wall
        status = f"error: {result['error']}" if "error" in result else "ok"
        self.log(f"  {label:<38} {wall:6.1f} s  {status}")
        return result


#: ``--scale`` rows that are not a worker mode of their own: report key -> (worker mode, environment)
SCALE_VARIANTS = {
    "ortmodule-level1": ("ortmodule", {"ORTMODULE_MEMORY_OPT_LEVEL": "1"}),
    # level 1 with the products on PyTorch's kernels where measured faster, kept, not recomputed
    "ortmodule-level1-auto": (
        "ortmodule",
        {"ORTMODULE_MEMORY_OPT_LEVEL": "1", "ORTMODULE_KERNEL_CHOICE": "AUTO"},
    ),
    "ortmodule-level2": ("ortmodule", {"ORTMODULE_MEMORY_OPT_LEVEL": "2"}),
    "ortmodule-warm": ("ortmodule", {}),
}


def run_scale(
    runner: Runner, report: Report, models: list[str], modes: list[str], steps: list[str]
) -> None:
    """The real-size rows: one fresh process per (model, mode) of :data:`SCALE_MODES`, the
    later steps' RSS sampled; ``ortmodule`` fills an export cache that ``ortmodule-warm``
    (a second process) starts from."""
    for model in models:
        print(f"{model}: {WORKLOADS[model].description}", flush=True)
        cache = runner.tmp / f"cache-{model}"
        cache.mkdir(exist_ok=True)
        for mode in modes:
            worker_mode, env = SCALE_VARIANTS.get(mode, (mode, {}))
            base = ["train", "--model", model, "--mode", worker_mode, "--sample-rss"]
            if mode == "ortmodule-warm":
                if (model, "ortmodule") not in report.runs:
                    continue
                args, env = [*base, "--steps", "0", "1"], {"ORTMODULE_CACHE_DIR": str(cache)}
                label = "ortmodule (warm: prefilled cache)"
            elif mode == "ortmodule":
                args, env = [*base, *steps], {"ORTMODULE_CACHE_DIR": str(cache)}
                label = "ortmodule (cold, fills the cache)"
            elif mode == "compile":
                args = [*base, *steps]
                env = {"TORCHINDUCTOR_CACHE_DIR": str(runner.tmp / f"inductor-{model}")}
                label = mode
            else:
                args, label = [*base, *steps], mode
            report.runs[(model, mode)] = runner.run(label, args, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--full", action="store_true", help="bigger configurations and more steps")
    parser.add_argument(
        "--scale",
        action="store_true",
        help="the real-size set instead (issue #41): GPT-2 124M and a 350M Llama, each with "
        "eager, eager checkpointing, torch.compile, ORTModule cold and warm and recompute "
        "levels 1 and 2; --models picks among them, --scale-modes among the modes",
    )
    parser.add_argument(
        "--scale-modes", nargs="+", choices=SCALE_MODES, help="with --scale: these rows only"
    )
    parser.add_argument("--note", help="a line for the report (e.g. what else ran on the machine)")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS))
    parser.add_argument("--modes", nargs="+", choices=WORKER_MODES, default=list(MODES))
    parser.add_argument(
        "--bf16",
        action="store_true",
        help=f"also run {', '.join(AUTOCAST_MODELS)} under bfloat16 autocast: eager, ORTModule and "
        "torch.compile, fp32 eager the baseline, per process and interleaved in one process",
    )
    parser.add_argument(
        "--no-micro", action="store_true", help="skip the benchmarks/bench_*.py micro-benchmarks"
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="skip the engine profile of the GPT decoder"
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="skip the per-step overhead benchmark"
    )
    parser.add_argument(
        "--no-interleaved",
        action="store_true",
        help="skip the interleaved runs (modes taking turns in one process per model)",
    )
    parser.add_argument(
        "--machine", help="machine name in the results file name (default: from the CPU)"
    )
    parser.add_argument(
        "--output", type=Path, help="results file (default benchmarks/results/<date>-<machine>.md)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        nargs=2,
        metavar=("WARMUP", "MEASURED"),
        help="override every model's steps",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads for PyTorch and the engine in every process (default: PyTorch's, one per core)",
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds per process (default 420, 1800 with --full)"
    )
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = list(SCALE_MODELS if args.scale else DEFAULT_MODELS)
    if args.scale:
        # real sizes are benchmarks of their own: none of the toy suite's extra runs
        args.no_micro = args.no_overhead = args.no_interleaved = args.no_profile = True

    info = machine_info()
    name = args.machine or machine_slug(info)
    output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{name}.md"
    timeout = args.timeout or (1800.0 if args.full or args.scale else 420.0)
    runner = Runner(args.full, timeout, args.threads)
    report = Report(
        info=info,
        full=args.full,
        command="python -m benchmarks"
        + "".join(" " + shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        load_before=os.getloadavg(),
        threads=args.threads,
        note=args.note,
    )
    started = time.perf_counter()
    print(
        f"ortmodule benchmarks ({'full' if args.full else 'quick'}) on {info['cpu']}, {info['cores']} cores; "
        f"load average {report.load_before[0]:.1f}",
        flush=True,
    )
    try:
        if args.scale:
            steps = ["--steps", *map(str, args.steps)] if args.steps else []
            run_scale(runner, report, args.models, list(args.scale_modes or SCALE_MODES), steps)
        # --scale runs only its own rows
        for model in [] if args.scale else args.models:
            print(f"{model}: {WORKLOADS[model].description}", flush=True)
            cache = runner.tmp / f"cache-{model}"
            cache.mkdir()
            modes = list(args.modes)
            if args.bf16 and model in AUTOCAST_MODELS:
                modes += [m for m in ("eager", *AUTOCAST_MODES) if m not in modes]
            for mode in modes:
                base = ["train", "--model", model, "--mode", mode]
                steps = ["--steps", *map(str, args.steps)] if args.steps else []
                if mode == "ortmodule":
                    env = {"ORTMODULE_CACHE_DIR": str(cache)}
                    report.runs[(model, mode)] = runner.run(
                        f"{mode} (cold, fills the cache)", [*base, *steps], env
                    )
                    report.runs[(model, "ortmodule-warm")] = runner.run(
                        f"{mode} (warm: prefilled cache)", [*base, "--steps", "0", "1"], env
                    )
                    if model in LABEL_SPARSITY_MODELS:
                        report.runs[(model, "ortmodule-label-off")] = runner.run(
                            f"{mode} (label sparsity off)",
                            [*base, *steps],
                            {"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "0"},
                        )
                    if model in PADDING_MODELS:
                        report.runs[(model, "ortmodule-padding")] = runner.run(
                            f"{mode} (padding elimination on)", [*base, *steps], PADDING_ELIMINATION
                        )
                elif mode.startswith("compile"):
                    # a fresh inductor cache: its first step is a cold compile, like ours is a cold export
                    env = {"TORCHINDUCTOR_CACHE_DIR": str(runner.tmp / f"inductor-{model}-{mode}")}
                    report.runs[(model, mode)] = runner.run(mode, [*base, *steps], env)
                else:
                    report.runs[(model, mode)] = runner.run(mode, [*base, *steps])
            if model == "gpt" and "ortmodule" in args.modes and not args.no_profile:
                prefix = str(runner.tmp / "gpt-profile")
                report.profile = runner.run(
                    "ortmodule (engine profiler on)",
                    [
                        *["train", "--model", model, "--mode", "ortmodule"],
                        "--profile",
                        prefix,
                        "--steps",
                        "1",
                        "3",
                    ],
                )
        if (
            not args.no_interleaved
            and "eager" in args.modes
            and len(set(args.modes) & set(MODES)) > 1
        ):
            print("interleaved: the modes take turns, one process per model", flush=True)
            for model in args.models:
                ratio = ["ratio", "--model", model, "--modes"]
                ratio += [m for m in args.modes if m in MODES]
                ratio += ["--rounds", str(INTERLEAVED_ROUNDS)]
                report.interleaved[model] = runner.run(model, ratio)
                if model in PADDING_MODELS and "ortmodule" in args.modes:
                    padded = f"{model}, padding elimination on"
                    report.interleaved[padded] = runner.run(padded, ratio, PADDING_ELIMINATION)
        if not args.no_interleaved and args.bf16:
            print(
                "interleaved under bfloat16 autocast: fp32 eager and the autocast modes", flush=True
            )
            for model in (m for m in args.models if m in AUTOCAST_MODELS):
                ratio = ["ratio", "--model", model, "--modes", "eager", *AUTOCAST_MODES]
                # --steps sets the rounds of these (emulated bfloat16 steps take seconds each)
                ratio += (
                    ["--steps", *map(str, args.steps)]
                    if args.steps
                    else ["--rounds", str(INTERLEAVED_ROUNDS)]
                )
                report.autocast[model] = runner.run(f"{model}, bf16 autocast", ratio)
        if not args.no_overhead:
            print("overhead: Linear(8, 8) on a 4x8 batch, forward + backward", flush=True)
            for mode in ("eager", "ortmodule"):
                report.overhead[mode] = runner.run(mode, ["overhead", "--mode", mode])
        if not args.no_micro:
            print("micro-benchmarks: benchmarks/bench_*.py", flush=True)
            for micro in _micro_names():
                report.micro[micro] = runner.run(micro, ["micro", "--name", micro])
    finally:
        report.commands = runner.commands
        report.seconds = time.perf_counter() - started
        report.load_after = os.getloadavg()
        runner.close()
    output.parent.mkdir(parents=True, exist_ok=True)
    write_report(report, output)
    raw = {
        "info": report.info,
        "command": report.command,
        "threads": args.threads,
        "note": args.note,
        "load_before": report.load_before,
        "load_after": report.load_after,
        "runs": {f"{model}/{mode}": run for (model, mode), run in report.runs.items()},
        "profile": report.profile,
        "overhead": report.overhead,
        "interleaved": report.interleaved,
        "autocast": report.autocast,
        "micro": report.micro,
    }
    output.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
    print()
    print(report.main_table())
    print()
    print(
        f"Wrote {output} and its raw figures {output.with_suffix('.json').name} in {report.seconds / 60:.1f} minutes."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
