"""Each suite, measured once per frontend; every function returns the JSON of its part.

A part is ``{"date", "machine", "versions", "command", "seconds": {frontend: wall s},
"results": {frontend: {item: {...}}}, ...}`` plus what defines the part (its sample, its sizes).
The suites run in child processes with ``ORTMODULE_EXPORTER`` set (see the package docstring).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..op_workers import sweep
from . import FRONTENDS

__all__ = [
    "OPINFO_DATA",
    "fuzz",
    "hf",
    "hf_sample",
    "machine",
    "opinfo",
    "opinfo_sample",
    "opinfo_status",
    "timing",
    "versions",
    "zoo",
]

ZOO_TESTS = Path("packages/ortmodule/tests/test_zoo_parity.py")
OPINFO_WORKER = Path("packages/ortmodule/tests/opinfo_sweep.py")
OPINFO_DATA = Path("packages/ortmodule/tests/opinfo_status.json")
MODELS_JSONL = Path("docs/models.jsonl")
#: an OpInfo op taking longer than this is stopped and reported (as test_opinfo.py does)
OPINFO_OP_TIMEOUT_S = 120.0
#: the speed options both frontends run the timings with: both keep the engine's kernels (the
#: kernel choice's measured routes may differ between runs and frontends), so the graphs compare
TIMING_ENV = {"ORTMODULE_KERNEL_CHOICE": "ENGINE"}


def machine() -> str:
    """``a 2-core AMD EPYC ... CPU machine (Linux)``."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"a {os.cpu_count()}-core {cpu} CPU machine ({platform.system()})"


def versions() -> dict[str, str]:
    """The versions of what the measurements depend on."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for dist in (
        "torch",
        "onnxruntime-training-cpu",
        "onnxruntime-training",
        "onnx",
        "onnxscript",
        "transformers",
        "ortmodule",
    ):
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return found


def _part(command: str) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions(),
        "command": command,
        "seconds": {},
        "results": {},
    }


def _env(frontend: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "ORTMODULE_EXPORTER": frontend,
        "ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE",
        "PYTHONHASHSEED": "0",
        **extra,
    }


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, for child processes spawned meanwhile."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[0][:limit] if lines else ""


# -- the zoo ---------------------------------------------------------------------------------------


def zoo(
    root: Path, work: Path, command: str, frontends: tuple[str, ...] = FRONTENDS
) -> dict[str, Any]:
    """``test_zoo_parity.py`` under pytest once per frontend: every test's outcome."""
    part = _part(command)
    part["tests"] = str(ZOO_TESTS)
    for frontend in frontends:
        xml = work / f"zoo-{frontend}.xml"
        xml.unlink(missing_ok=True)
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pytest", str(ZOO_TESTS), "-q", "-p", "no:cacheprovider",
             f"--junitxml={xml}"],
            env=_env(frontend), cwd=root, check=False, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        part["seconds"][frontend] = round(time.monotonic() - start, 1)
        found: dict[str, dict[str, str]] = {}
        if not xml.exists():
            found["(pytest)"] = {"outcome": "failed", "error": "pytest wrote no report"}
        for case in ET.parse(xml).getroot().iter("testcase") if xml.exists() else ():
            outcome, error = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                    error = _first_line(child.get("message") or child.text or "")
                elif child.tag == "skipped":
                    outcome, error = "skipped", _first_line(child.get("message") or "")
            found[str(case.get("name"))] = {"outcome": outcome, "error": error}
        part["results"][frontend] = dict(sorted(found.items()))
    return part


# -- Hugging Face --------------------------------------------------------------------------------


def hf_sample(root: Path, every: int) -> list[str]:
    """Every ``every``-th model type (sorted) of those that train in eager in docs/models.jsonl."""
    from ..hf_coverage.run_one import TRAINS_IN_EAGER

    trains = set()
    for line in (root / MODELS_JSONL).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["status"] in TRAINS_IN_EAGER:
                trains.add(row["model_type"])
            else:
                trains.discard(row["model_type"])
    return sorted(trains)[::every]


def _run_hf(
    root: Path, work: Path, types: list[str], timeout: float, frontend: str, part: dict[str, Any]
) -> None:
    results = work / f"hf-{frontend}.jsonl"
    results.unlink(missing_ok=True)
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "ortmodule_testing.hf_coverage", "--only", *types,
         "--out", str(work / f"hf-{frontend}.md"), "--results", str(results), "--rerun",
         "--timeout", str(timeout), "--log", str(work / f"hf-{frontend}.log")],
        env=_env(frontend), cwd=root, check=False, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    part["seconds"][frontend] = round(time.monotonic() - start, 1)


def hf(
    root: Path,
    work: Path,
    command: str,
    types: list[str],
    every: int | None,
    timeout: float,
    frontends: tuple[str, ...] = FRONTENDS,
    collect_only: bool = False,
) -> dict[str, Any]:
    """``python -m ortmodule_testing.hf_coverage --only TYPES --rerun`` once per frontend.

    ``collect_only``: run nothing, read the results files an earlier (interrupted) run left
    in ``work``; a type without a result is ``not-run``."""
    part = _part(command)
    part["types"] = types
    part["every"] = every
    part["collected"] = collect_only
    for frontend in frontends:
        results = work / f"hf-{frontend}.jsonl"
        if not collect_only:
            _run_hf(root, work, types, timeout, frontend, part)
        found: dict[str, dict[str, Any]] = {}
        if results.exists():
            for line in results.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    found[row["model_type"]] = {
                        "status": row["status"],
                        "error": _first_line(row["error"]),
                        "seconds": row["seconds"],
                    }
        part["results"][frontend] = {t: found.get(t, {"status": "not-run"}) for t in types}
    return part


# -- OpInfo --------------------------------------------------------------------------------------


def opinfo_status(result: dict[str, Any]) -> str:
    """A sweep result or a data-file entry as ``native``, ``aten``, ``wrong`` (a value or a
    gradient differs from eager), ``unsupported`` (an error) or ``skip`` (nothing to run)."""
    status = str(result["status"])
    if status in ("native", "aten", "skip"):
        return status
    error = str(result.get("error") or result.get("reason") or "")
    return "wrong" if error.startswith("AssertionError") else "unsupported"


def opinfo_sample(root: Path, every: int) -> list[str]:
    """Every ``every``-th op (sorted) of the OpInfo data file (which lists every testable op)."""
    ops = json.loads((root / OPINFO_DATA).read_text())["ops"]
    return sorted(ops)[::every]


def _git_commit(root: Path, path: Path) -> str:
    out = subprocess.run(
        ["git", "log", "-1", "--format=%h %cs", "--", str(path)],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return out.stdout.strip() or "uncommitted"


def opinfo(
    root: Path,
    command: str,
    ops: list[str],
    every: int,
    workers: int,
    torchscript_committed: bool,
    frontends: tuple[str, ...] = FRONTENDS,
) -> dict[str, Any]:
    """The OpInfo sweep of ``ops`` once per frontend; with ``torchscript_committed`` the
    TorchScript column is the committed data file, not a run."""
    part = _part(command)
    part["ops"] = ops
    part["every"] = every
    part["torchscript_source"] = (
        f"committed {OPINFO_DATA} ({_git_commit(root, OPINFO_DATA)})"
        if torchscript_committed
        else "measured"
    )
    for frontend in frontends:
        found: dict[str, dict[str, Any]] = {}
        if frontend == "torchscript" and torchscript_committed:
            committed = json.loads((root / OPINFO_DATA).read_text())["ops"]
            for op in ops:
                entry = committed[op]
                found[op] = {
                    "status": opinfo_status(entry),
                    "error": _first_line(entry.get("reason", "")),
                }
        else:
            start = time.monotonic()
            raw, _ = sweep(root / OPINFO_WORKER, ops, workers, _env(frontend), OPINFO_OP_TIMEOUT_S)
            part["seconds"][frontend] = round(time.monotonic() - start, 1)
            for op in ops:
                result = raw.get(op, {"status": "fail", "error": "not run (no worker)"})
                found[op] = {
                    "status": opinfo_status(result),
                    "error": _first_line(result.get("error", "")),
                }
        part["results"][frontend] = found
    return part


# -- the fuzzer ----------------------------------------------------------------------------------


def fuzz(
    command: str,
    seed: int,
    programs: int,
    timeout: float,
    frontends: tuple[str, ...] = FRONTENDS,
) -> dict[str, Any]:
    """The fuzzer's programs ``seed .. seed+programs-1`` once per frontend, not shrunk."""
    from ..fuzz.generate import generate_program
    from ..fuzz.worker import Worker

    part = _part(command)
    part["seed"] = seed
    part["programs"] = programs
    for frontend in frontends:
        found: dict[str, dict[str, str]] = {}
        start = time.monotonic()
        # the worker is a spawned process: it takes the environment of the moment it starts
        with _environ(_env(frontend)), Worker(timeout=timeout) as worker:
            for s in range(seed, seed + programs):
                outcome = worker.run(generate_program(s))
                found[str(s)] = {"status": outcome.status, "error": _first_line(outcome.detail)}
        part["seconds"][frontend] = round(time.monotonic() - start, 1)
        part["results"][frontend] = found
    return part


# -- time ----------------------------------------------------------------------------------------


def timing(
    root: Path, command: str, models: list[str], steps: int, frontends: tuple[str, ...] = FRONTENDS
) -> dict[str, Any]:
    """:mod:`.timing` in a fresh process per model and frontend, frontends in turn per model."""
    part = _part(command)
    part["models"] = models
    part["steps"] = steps
    part["settings"] = TIMING_ENV
    part["threads"] = 1  # timing.py sets it
    results: dict[str, dict[str, Any]] = {f: {} for f in frontends}
    seconds = dict.fromkeys(frontends, 0.0)
    for model in models:
        for frontend in frontends:
            start = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "ortmodule_testing.frontends.timing", model, str(steps)],
                env=_env(frontend, **TIMING_ENV), cwd=root, capture_output=True, text=True,
                check=False,
            )  # fmt: skip
            seconds[frontend] += time.monotonic() - start
            lines = out.stdout.strip().splitlines()
            if out.returncode == 0 and lines:
                results[frontend][model] = json.loads(lines[-1])
            else:
                results[frontend][model] = {
                    "error": _first_line(
                        out.stderr.strip().splitlines()[-1]
                        if out.stderr.strip()
                        else f"exit code {out.returncode}"
                    )
                }
    part["seconds"] = {f: round(s, 1) for f, s in seconds.items()}
    part["results"] = results
    return part
