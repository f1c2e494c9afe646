"""``python -m ortmodule_testing.fuzz --programs N --seed S [--out DIR]``.

Runs programs ``S .. S+N-1`` in a child process (eager against ORTModule, fallback disabled),
shrinks each failure and writes ``DIR/summary.md`` plus one standalone repro per failure.
Exit status 1 when any program was wrong, crashed, raised an unclear error or was invalid.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

from .generate import generate_program, replay
from .ops import GenConfig
from .program import Program
from .runner import Outcome
from .shrink import shrink
from .worker import Worker


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ortmodule_testing.fuzz", description=__doc__)
    p.add_argument("--programs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="the first program's seed")
    p.add_argument("--out", type=Path, default=Path("fuzz-out"))
    p.add_argument("--max-ops", type=int, default=GenConfig.max_ops)
    p.add_argument("--steps", type=int, default=GenConfig.steps)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per program")
    p.add_argument("--shrink-budget", type=int, default=120, help="runs per shrink")
    p.add_argument(
        "--shrink-per-kind", type=int, default=5, help="failures shrunk per kind (status, error)"
    )
    p.add_argument(
        "--data-dependent",
        action=argparse.BooleanOptionalAction,
        default=GenConfig.data_dependent,
        help="generate `if t.sum() > 0`, float(t)",
    )
    p.add_argument(
        "--linspace-by-shape",
        action=argparse.BooleanOptionalAction,
        default=GenConfig.linspace_by_shape,
        help="generate torch.linspace(a, b, t.shape[-1])",
    )
    p.add_argument(
        "--dynamic-loops",
        action=argparse.BooleanOptionalAction,
        default=GenConfig.dynamic_loops,
        help="loop over dims whose size changes between steps",
    )
    p.add_argument(
        "--input-inplace",
        action=argparse.BooleanOptionalAction,
        default=GenConfig.input_inplace,
        help="generate in-place writes to inputs",
    )
    p.add_argument(
        "--vector-batched-matmul",
        action=argparse.BooleanOptionalAction,
        default=GenConfig.vector_batched_matmul,
        help="generate matmul(v, x) with v 1-D and x batched",
    )
    p.add_argument(
        "--grad-cuts",
        action=argparse.BooleanOptionalAction,
        default=GenConfig.grad_cuts,
        help="generate x.detach() and torch.no_grad() blocks",
    )
    p.add_argument("--replay", help="run one program given by its comma-separated choices")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # every generator setting with a command-line flag of the same name; the rest keep defaults
    config = GenConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(GenConfig) if f.name in args}
    )
    args.out.mkdir(parents=True, exist_ok=True)
    counts: collections.Counter[str] = collections.Counter()
    shrunk_per_kind: collections.Counter[str] = collections.Counter()
    failures: list[tuple[Program, Outcome, Program, Outcome, Path | None]] = []
    #: error type -> seeds refused with it, and the first one's message
    refusals: dict[str, tuple[list[int], str]] = {}
    start = time.monotonic()
    with Worker(timeout=args.timeout) as worker:
        if args.replay:
            seeds: list[int] = [args.seed]
        else:
            seeds = list(range(args.seed, args.seed + args.programs))
        for n, seed in enumerate(seeds, 1):
            if args.replay:
                program = replay([int(c) for c in args.replay.split(",")], config, seed)
            else:
                program = generate_program(seed, config)
            outcome = worker.run(program)
            counts[outcome.status] += 1
            if outcome.status == "refused":
                kind = outcome.detail.split(":", 1)[0]
                refusals.setdefault(kind, ([], outcome.detail))[0].append(seed)
            if outcome.failed:
                small, small_outcome = program, outcome
                if shrunk_per_kind[outcome.signature] < args.shrink_per_kind:
                    shrunk_per_kind[outcome.signature] += 1
                    small, small_outcome = _shrunk(worker, program, outcome, config, args)
                path = args.out / f"{outcome.status}-{seed}.py"
                path.write_text(_repro(small, small_outcome, program, outcome))
                failures.append((program, outcome, small, small_outcome, path))
                print(f"[{n}/{len(seeds)}] seed {seed}: {outcome.status} -> {path}", flush=True)
            if n % 50 == 0:
                elapsed = time.monotonic() - start
                (args.out / "summary.md").write_text(
                    _summary(args, config, counts, failures, elapsed, refusals)
                )
            if n % 50 == 0 and not outcome.failed:
                print(
                    f"[{n}/{len(seeds)}] {dict(counts)} {time.monotonic() - start:.0f} s",
                    flush=True,
                )
    elapsed = time.monotonic() - start
    summary = _summary(args, config, counts, failures, elapsed, refusals)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    bad = sum(counts[s] for s in ("wrong", "error", "crashed", "invalid"))
    return 1 if bad else 0


def _shrunk(
    worker: Worker, program: Program, outcome: Outcome, config: GenConfig, args: argparse.Namespace
) -> tuple[Program, Outcome]:
    """The smallest program failing with ``outcome``'s signature, and its outcome."""
    seen: dict[str, Outcome] = {}

    def fails(candidate: Program) -> bool:
        got = worker.run(candidate)
        seen[candidate.to_source()] = got
        return got.signature == outcome.signature

    small = shrink(program, fails, config, args.shrink_budget)
    return small, seen.get(small.to_source(), outcome)


def _repro(small: Program, small_outcome: Outcome, program: Program, outcome: Outcome) -> str:
    def comment(text: str) -> str:
        return "\n".join("# " + line for line in text.splitlines())

    return (
        f"# {small_outcome.status} (shrunk from seed {program.seed}: "
        f"{len(program.live_ops())} ops -> {len(small.live_ops())})\n"
        f"{comment(small_outcome.detail)}\n#\n# before shrinking:\n{comment(outcome.detail)}\n"
        + small.to_source()
    )


def _summary(
    args: argparse.Namespace,
    config: GenConfig,
    counts: collections.Counter[str],
    failures: list[tuple[Program, Outcome, Program, Outcome, Path | None]],
    elapsed: float,
    refusals: dict[str, tuple[list[int], str]] | None = None,
) -> str:
    ran = sum(counts.values())
    lines = [
        "# ortmodule fuzz summary",
        "",
        f"seeds {args.seed}..{args.seed + ran - 1}, {config}, {elapsed:.0f} s",
        "",
        "| ran | equal | wrong | refused | error | crashed | invalid |",
        "|---|---|---|---|---|---|---|",
        f"| {ran} | {counts['equal']} | {counts['wrong']} | {counts['refused']} | "
        f"{counts['error']} | {counts['crashed']} | {counts['invalid']} |",
        "",
    ]
    for program, outcome, small, _, path in failures:
        first = outcome.detail.splitlines()[0] if outcome.detail else ""
        lines.append(
            f"- seed {program.seed}: {outcome.status} ({len(small.live_ops())} ops shrunk) "
            f"{path}: {first}"
        )
    if refusals:
        # a refusal is a clear error, not a failure; an EngineBuildError among them is a
        # program the engine could not build, which is worth a look
        lines += ["", "| refused with | programs | seeds | first message |", "|---|---|---|---|"]
        for kind, (seeds, detail) in sorted(refusals.items(), key=lambda r: -len(r[1][0])):
            shown = ", ".join(str(s) for s in seeds[:5]) + (", ..." if len(seeds) > 5 else "")
            message = detail.splitlines()[0][:200].replace("|", "\\|") if detail else ""
            lines.append(f"| {kind} | {len(seeds)} | {shown} | {message} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
