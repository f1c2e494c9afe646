"""``python -m ortmodule_testing.frontends [--parts zoo hf opinfo fuzz timing]``.

Measures the named suites on both frontends, replaces their parts in ``--json`` (the other
parts stay, so suites can be measured one at a time, also by processes running side by side:
the file is rewritten under a lock) and renders ``--out`` from the whole file. With
``--frontends`` naming one frontend, the other's results of the earlier run of the same sample
are kept, and the page says from which run (:func:`carry_other_frontends`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import FRONTENDS, measure
from .render import render

PARTS = ("zoo", "hf", "opinfo", "fuzz", "timing")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ortmodule_testing.frontends", description=__doc__)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--frontends", nargs="+", choices=FRONTENDS, default=list(FRONTENDS))
    p.add_argument("--root", type=Path, default=Path.cwd(), help="the repository's root")
    p.add_argument("--json", type=Path, default=Path("docs/frontends.json"))
    p.add_argument("--out", type=Path, default=Path("docs/frontends.md"))
    p.add_argument("--work", type=Path, default=None, help="scratch files (default: a temp dir)")
    p.add_argument("--render-only", action="store_true", help="rewrite --out from --json only")
    p.add_argument("--hf-every", type=int, default=8, help="every k-th type that trains in eager")
    p.add_argument("--hf-types", nargs="+", default=None, help="these types instead")
    p.add_argument("--hf-timeout", type=float, default=300.0, help="seconds per model type")
    p.add_argument(
        "--hf-collect",
        action="store_true",
        help="run nothing: collect the results files an interrupted run left in --work",
    )
    p.add_argument("--opinfo-every", type=int, default=1, help="every k-th op (sorted)")
    p.add_argument("--opinfo-workers", type=int, default=1)
    p.add_argument(
        "--opinfo-torchscript",
        choices=("run", "committed"),
        default="run",
        help="run the TorchScript side, or read the committed opinfo_status.json",
    )
    p.add_argument("--fuzz-programs", type=int, default=200)
    p.add_argument("--fuzz-seed", type=int, default=0)
    p.add_argument("--fuzz-timeout", type=float, default=120.0, help="seconds per program")
    p.add_argument("--timing-models", nargs="+", default=["gpt", "bert", "cnn"])
    p.add_argument("--timing-steps", type=int, default=30)
    return p.parse_args(argv)


def _measure(part: str, args: argparse.Namespace, command: str, work: Path) -> dict[str, Any]:
    root, frontends = args.root, tuple(args.frontends)
    if part == "zoo":
        return measure.zoo(root, work, command, frontends)
    if part == "hf":
        every = None if args.hf_types else args.hf_every
        types = args.hf_types or measure.hf_sample(root, args.hf_every)
        return measure.hf(
            root, work, command, types, every, args.hf_timeout, frontends, args.hf_collect
        )
    if part == "opinfo":
        ops = measure.opinfo_sample(root, args.opinfo_every)
        committed = args.opinfo_torchscript == "committed"
        return measure.opinfo(
            root,
            command,
            ops,
            args.opinfo_every,
            args.opinfo_workers,
            committed,
            opinfo_frontends(frontends, committed),
        )
    if part == "fuzz":
        return measure.fuzz(
            command, args.fuzz_seed, args.fuzz_programs, args.fuzz_timeout, frontends
        )
    return measure.timing(root, command, args.timing_models, args.timing_steps, frontends)


def opinfo_frontends(frontends: tuple[str, ...], torchscript_committed: bool) -> tuple[str, ...]:
    """The frontends an OpInfo part holds: the committed TorchScript column is read (it costs
    nothing) even when only ``torch_export`` is run, so a new sample (``--opinfo-every``) of one
    frontend has both columns instead of being refused after the sweep."""
    if torchscript_committed and "torchscript" not in frontends:
        return ("torchscript", *frontends)
    return frontends


#: what picks a part's sample: results are carried from an earlier run only over the same sample
SAMPLE_KEYS = ("types", "every", "ops", "seed", "programs", "models", "steps", "tests")


def carry_other_frontends(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` (a run of some frontends) with the other frontends' results of ``old`` (an
    earlier run of the same sample), each marked in ``carried`` with the run it came from, so
    one frontend can be re-measured alone and the page says which column was not rerun."""
    if old is None:
        return new
    missing = [f for f in old.get("results", {}) if f not in new["results"]]
    if not missing:
        return new
    differs = [k for k in SAMPLE_KEYS if k in new and old.get(k) != new[k]]
    if differs:
        raise SystemExit(
            f"cannot keep {', '.join(missing)} of the earlier run beside this one: its "
            f"{', '.join(differs)} differ; rerun every frontend (--frontends) on this sample"
        )
    merged = dict(new)
    merged["results"] = {**new["results"]}
    merged["seconds"] = {**new.get("seconds", {})}
    carried = {f: c for f, c in old.get("carried", {}).items() if f in missing}
    for frontend in missing:
        merged["results"][frontend] = old["results"][frontend]
        if frontend in old.get("seconds", {}):
            merged["seconds"][frontend] = old["seconds"][frontend]
        carried.setdefault(frontend, {"date": old["date"], "command": old["command"]})
    merged["carried"] = carried
    return merged


def _store(path: Path, part: str, value: dict[str, Any]) -> dict[str, Any]:
    """Replace ``part`` in the JSON file under a lock; return the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # the lock lives outside the repository: one name per JSON file
    lock_path = Path(tempfile.gettempdir()) / ("frontends" + str(path.resolve()).replace("/", "_"))
    with open(lock_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        value = carry_other_frontends(data.get("parts", {}).get(part), value)
        data.setdefault("parts", {})[part] = value
        data["parts"] = {p: data["parts"][p] for p in PARTS if p in data["parts"]}
        path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    raw = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m ortmodule_testing.frontends", *raw])
    if not args.render_only:
        work = args.work or Path(tempfile.mkdtemp(prefix="frontends-"))
        work.mkdir(parents=True, exist_ok=True)
        for part in args.parts:
            print(f"measuring {part} ...", flush=True)
            value = _measure(part, args, command, work)
            # kept in the scratch folder first: a refusal to store it loses no measurement
            (work / f"{part}-result.json").write_text(json.dumps(value, indent=1) + "\n")
            _store(args.json, part, value)
            print(f"{part}: {value['seconds']} s", flush=True)
    data = json.loads(args.json.read_text())
    args.out.write_text(render(data))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
