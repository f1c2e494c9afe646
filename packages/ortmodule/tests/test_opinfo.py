"""PyTorch's OpInfo database under ORTModule: every testable op against its recorded status.

``opinfo_status.json`` records, per op, ``native`` (the engine runs and differentiates it),
``aten`` (it trains, with some of it run by PyTorch inside the engine), ``unsupported`` (with
the reason) or ``skip`` (no sample to run). Each op runs in a worker process
(``opinfo_sweep.py``): an op that kills the process fails its own test and the sweep goes on
in a fresh worker. A regression fails, and so does an op that starts passing, until the data
file says so; ``docs/operators.md`` is generated from the same file (``tools/operators_doc.py``).

Rewrite the data file from a run (each unsupported op's reason is the error of that run):
``ORTMODULE_OPINFO_UPDATE=1 pytest packages/ortmodule/tests/test_opinfo.py``
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ortmodule_testing import op_workers

HERE = Path(__file__).resolve().parent
DATA = HERE / "opinfo_status.json"
WORKER = HERE / "opinfo_sweep.py"
UPDATE = os.environ.get("ORTMODULE_OPINFO_UPDATE") == "1"

pytest.importorskip("expecttest", reason="OpInfo needs expecttest (the ortmodule test extra)")


def _expected() -> dict[str, dict[str, str]]:
    return dict(json.loads(DATA.read_text())["ops"])


EXPECTED = _expected()


@pytest.fixture(scope="session")
def sweep(request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, Any]]]:
    """Results of the ops selected in this pytest session (all of them, or what ``-k`` kept)."""
    selected = [
        item.callspec.params["op"]
        for item in request.session.items
        if item.originalname == "test_opinfo_op" and hasattr(item, "callspec")
    ]
    results, known = op_workers.sweep(WORKER, selected, workers=max(1, min(2, os.cpu_count() or 1)))
    results["__known__"] = {"ops": known}
    yield results
    if UPDATE:
        _write_data(results)
    dump = os.environ.get("ORTMODULE_OPINFO_DUMP")
    if dump:
        Path(dump).write_text(json.dumps(results, indent=1))


def _write_data(results: dict[str, dict[str, Any]]) -> None:
    ops = json.loads(DATA.read_text())
    table: dict[str, dict[str, str]] = ops["ops"]
    for name in results["__known__"]["ops"]:
        table.setdefault(name, {"status": "unsupported", "reason": "not run yet"})
    for name, result in results.items():
        if name == "__known__":
            continue
        status = result["status"]
        if status == "fail":
            # the reason is this run's error, so it never describes a failure since fixed
            reason = result["error"]
            if result.get("died"):
                reason = f"process dies: {reason}"
            table[name] = {"status": "unsupported", "reason": reason}
        else:
            table[name] = {
                "status": status,
                **({"reason": result["error"]} if "error" in result else {}),
            }
    ops["ops"] = dict(sorted(table.items()))
    DATA.write_text(json.dumps(ops, indent=1) + "\n")


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_opinfo_op(op: str, sweep: dict[str, dict[str, Any]]) -> None:
    expected = EXPECTED[op]
    result = sweep[op]
    status = result["status"]
    if UPDATE:
        return
    if status == "fail":
        assert expected["status"] == "unsupported", (
            f"{op} is recorded as {expected['status']} but fails on its {result.get('sample')} "
            f"sample: {result['error']}"
        )
        # a known crash is recorded as such ("process dies ..."); any other is a failure
        assert not result.get("died") or expected["reason"].startswith("process dies"), (
            f"{op} killed the process: {result['error']}"
        )
    else:
        assert status == expected["status"], (
            f"{op} now gives {status!r} (recorded {expected['status']!r}); if that is an "
            "improvement, rewrite the data file (ORTMODULE_OPINFO_UPDATE=1, see this module)"
        )


def test_data_file_lists_every_testable_op(sweep: dict[str, dict[str, Any]]) -> None:
    known = set(sweep["__known__"]["ops"])
    if not known:
        pytest.skip("no op ran in this session (nothing selected)")
    assert known == set(EXPECTED), (
        f"OpInfo ops missing from {DATA.name}: {sorted(known - set(EXPECTED))}; "
        f"recorded but no longer in OpInfo: {sorted(set(EXPECTED) - known)}"
    )


def test_goal_share_of_ops_that_train() -> None:
    """Issue #20's goal: at least 95% of the testable ops train (forward and gradient)."""
    testable = [v for v in EXPECTED.values() if v["status"] != "skip"]
    passing = [v for v in testable if v["status"] in ("native", "aten")]
    assert len(passing) >= 0.95 * len(testable), f"{len(passing)} of {len(testable)} ops train"
