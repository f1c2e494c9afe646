"""docs/frontends.md is generated from docs/frontends.json and must not drift from it.

Regenerate the page from the data: ``python -m ortmodule_testing.frontends --render-only``;
measure again: ``python -m ortmodule_testing.frontends`` (``nox -s frontends``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortmodule_testing.frontends import FRONTENDS
from ortmodule_testing.frontends.render import HEADER, render

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "docs" / "frontends.json"
DOC = ROOT / "docs" / "frontends.md"


def test_frontends_page_is_the_rendered_data() -> None:
    expected = render(json.loads(DATA.read_text()))
    assert DOC.read_text() == expected, (
        "docs/frontends.md is stale: python -m ortmodule_testing.frontends --render-only"
    )


def test_every_part_measured_both_frontends_and_says_how() -> None:
    parts = json.loads(DATA.read_text())["parts"]
    assert set(parts) == {"zoo", "hf", "opinfo", "fuzz", "timing"}
    for name, part in parts.items():
        assert set(part["results"]) == set(FRONTENDS), name
        for key in ("date", "machine", "versions", "command"):
            assert part[key], f"{name} has no {key}"
        items = [set(part["results"][f]) for f in FRONTENDS]
        assert items[0] == items[1], f"{name}: the frontends ran different samples"


def test_page_starts_with_the_generated_header() -> None:
    assert DOC.read_text().splitlines()[0] == HEADER


def _part(date: str, results: dict[str, dict[str, str]], **sample: object) -> dict[str, object]:
    return {
        "date": date,
        "machine": "m",
        "versions": {"torch": "2.13"},
        "command": f"run of {date}",
        "seconds": {f: 1.0 for f in results},
        "results": results,
        **sample,
    }


def test_a_frontend_not_rerun_is_carried_and_the_page_says_so() -> None:
    from ortmodule_testing.frontends.__main__ import carry_other_frontends
    from ortmodule_testing.frontends.render import _meta

    old = _part("day 1", {"torchscript": {"a": "parity"}, "torch_export": {"a": "error"}}, every=8)
    new = _part("day 2", {"torch_export": {"a": "parity"}}, every=8)
    merged = carry_other_frontends(old, new)
    assert merged["results"] == {"torch_export": {"a": "parity"}, "torchscript": {"a": "parity"}}
    assert merged["carried"] == {"torchscript": {"date": "day 1", "command": "run of day 1"}}
    assert any("`torchscript` column was not rerun" in line for line in _meta(merged))
    # carried again by a later run of the other frontend alone: still the day-1 run
    again = carry_other_frontends(merged, _part("day 3", {"torch_export": {"a": "x"}}, every=8))
    assert again["carried"]["torchscript"]["date"] == "day 1"
    # a run of every frontend carries nothing
    both = _part("day 4", {"torchscript": {"a": "p"}, "torch_export": {"a": "p"}}, every=8)
    assert "carried" not in carry_other_frontends(merged, both)


def test_results_of_another_sample_are_not_carried() -> None:
    from ortmodule_testing.frontends.__main__ import carry_other_frontends

    old = _part("day 1", {"torchscript": {"a": "parity"}, "torch_export": {"a": "x"}}, every=8)
    with pytest.raises(SystemExit, match="every differ"):
        carry_other_frontends(old, _part("day 2", {"torch_export": {"b": "parity"}}, every=4))


def test_committed_torchscript_opinfo_column_is_read_for_a_new_sample() -> None:
    """``--frontends torch_export --opinfo-torchscript committed`` over a new ``--opinfo-every``
    holds the committed TorchScript column: nothing to carry, so nothing is refused after the
    sweep (a whole-sweep run of torch_export was lost that way)."""
    from ortmodule_testing.frontends.__main__ import opinfo_frontends

    assert opinfo_frontends(("torch_export",), True) == ("torchscript", "torch_export")
    assert opinfo_frontends(("torch_export",), False) == ("torch_export",)
    assert opinfo_frontends(FRONTENDS, True) == FRONTENDS
