"""Plan strings, levels and the JSON plan file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortmodule_memory.plans import (
    MemoryOptLevel,
    Plan,
    PlanError,
    read_plan_file,
    select_plans,
    write_plan_file,
)


def test_parse_plan() -> None:
    assert Plan.parse("FusedMatMul+Add+:1:-1") == Plan("FusedMatMul+Add+", 1, -1)
    assert str(Plan.parse(" Cast+:2:3 ")) == "Cast+:2:3"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("Gelu+", "is not a recompute plan"),
        ("Gelu+:x:-1", "must be integers"),
        ("Gelu+:3:-1", "type 3 is unknown"),
        ("Gelu+:1:0", "count 0"),
    ],
)
def test_bad_plans_say_why(text: str, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        Plan.parse(text)


def test_levels_select_plan_types() -> None:
    detected = ["Gelu+:1:-1", "Cast+:2:-1", "Reshape+:1:-1,Cast+:2:-1"]
    assert select_plans(detected, MemoryOptLevel.USER_SPECIFIED) == []
    assert select_plans(detected, 1) == ["Gelu+:1:-1", "Reshape+:1:-1"]
    assert select_plans(detected, 2) == detected


def test_plan_file_round_trip(tmp_path: Path) -> None:
    path = write_plan_file(["Gelu+:1:-1", "Cast+:2:2"], tmp_path)
    assert json.loads(Path(path).read_text()) == ["Gelu+:1:-1", "Cast+:2:2"]
    assert read_plan_file(path) == ["Gelu+:1:-1", "Cast+:2:2"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("Gelu+:1:-1", "is not JSON"),
        ('"Gelu+:1:-1"', "JSON list of strings"),
        ('["Gelu+"]', "is not a recompute plan"),
    ],
)
def test_bad_plan_file_names_the_file(tmp_path: Path, body: str, says: str) -> None:
    path = tmp_path / "plans.json"
    path.write_text(body)
    with pytest.raises(PlanError, match=says) as info:
        read_plan_file(path)
    assert "ORTMODULE_MEMORY_OPT_CONFIG file" in str(info.value) and str(path) in str(info.value)
