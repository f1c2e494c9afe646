"""``python -m ortmodule_testing.hf_coverage --out docs/models.md [--only TYPE ...]``.

Results go to a JSON-lines file as each model type finishes (``--results``), and the report is
rewritten after each, so an interrupted sweep keeps what it did; run again to go on where it
stopped (types already in the results file are skipped unless ``--rerun``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from .report import render
from .run_one import Result
from .sweep import Sweeper
from .tasks import TASKS, TASKS_BY_NAME, model_types


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"a {os.cpu_count()}-core {cpu} CPU machine ({platform.system()})"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for dist in ("torch", "transformers", "onnxruntime-training"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return ", ".join(parts) + "." if parts else ""


def load(path: Path) -> dict[str, Result]:
    """The results file: model type -> its last result."""
    found: dict[str, Result] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = Result(**json.loads(line))
                found[r.model_type] = r
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ortmodule_testing.hf_coverage")
    parser.add_argument("--out", type=Path, default=Path("docs/models.md"))
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="JSON lines, one result per model type (default: OUT with .jsonl)",
    )
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument(
        "--task", nargs="+", choices=list(TASKS_BY_NAME), help="the model types of these tasks only"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    parser.add_argument(
        "--per-process",
        type=int,
        default=20,
        help="model types per worker process before a fresh one (1: each alone)",
    )
    parser.add_argument("--log", type=Path, default=None, help="the worker's output")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--machine", default=None)
    parser.add_argument("--note", default="", help="a paragraph for the report's top")
    parser.add_argument("--rerun", action="store_true", help="rerun types already in --results")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report only")
    args = parser.parse_args(argv)  # fmt: skip

    results_path = args.results or args.out.with_suffix(".jsonl")
    everything = model_types(TASKS)
    todo = everything
    if args.task:
        todo = [(t, task) for t, task in todo if task.name in args.task]
    if args.only:
        known = dict(everything)
        missing = [t for t in args.only if t not in known]
        if missing:
            parser.error(f"not in the mappings: {', '.join(missing)}")
        todo = [(t, known[t]) for t in args.only]
    done = load(results_path)
    if not args.rerun:
        todo = [(t, task) for t, task in todo if t not in done]

    machine = args.machine or _machine()
    versions = _versions()

    def write_report() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            render(list(done.values()), len(everything), args.date, machine, versions, args.note)
        )

    if not args.report_only and todo:
        results_path.parent.mkdir(parents=True, exist_ok=True)
        log = str(args.log) if args.log else None
        with Sweeper(args.timeout, args.per_process, log) as sweeper:
            for i, (model_type, task) in enumerate(todo, 1):
                result = sweeper.run(model_type, task.name)
                done[model_type] = result
                with results_path.open("a") as f:
                    f.write(json.dumps(result.to_json()) + "\n")
                print(f"[{i}/{len(todo)}] {model_type}: {result.status} {result.seconds:.0f}s "
                      f"{result.error[:150]}", flush=True)  # fmt: skip
                write_report()
    write_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
