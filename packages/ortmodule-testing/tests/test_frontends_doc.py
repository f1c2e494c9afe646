"""docs/frontends.md is generated from docs/frontends.json and must not drift from it.

Regenerate the page from the data: ``python -m ortmodule_testing.frontends --render-only``;
measure again: ``python -m ortmodule_testing.frontends`` (``nox -s frontends``).
"""

from __future__ import annotations

import json
from pathlib import Path

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
