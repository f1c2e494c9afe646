"""DebugOptions(memory_opt_level=..., memory_opt_config=...): the memory variables from code."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortmodule.debug_options import DebugOptions
from ortmodule.options import InvalidOptionError, RuntimeOptions


def test_debug_options_set_the_level_and_the_environment_wins() -> None:
    options = RuntimeOptions.resolve(DebugOptions(memory_opt_level=1), environ={})
    assert (options.memory_opt_level, options.source("memory_opt_level")) == (1, "DebugOptions")
    env = {"ORTMODULE_MEMORY_OPT_LEVEL": "2"}
    options = RuntimeOptions.resolve(DebugOptions(memory_opt_level=1), environ=env)
    assert (options.memory_opt_level, options.source("memory_opt_level")) == (2, "environment")
    assert (
        RuntimeOptions.resolve(DebugOptions(), environ={}).source("memory_opt_level") == "default"
    )


def test_debug_options_plan_file(tmp_path: Path) -> None:
    plans = tmp_path / "plans.json"
    plans.write_text('["Gelu+:1:-1"]')
    options = RuntimeOptions.resolve(DebugOptions(memory_opt_config=str(plans)), environ={})
    assert options.memory_opt_config == str(plans)
    with pytest.raises(InvalidOptionError, match=r"DebugOptions\(memory_opt_config=.*no file at"):
        RuntimeOptions.resolve(DebugOptions(memory_opt_config=str(tmp_path / "x.json")), environ={})


@pytest.mark.parametrize("level", [3, -1, True, "1"])
def test_bad_level_names_the_field(level: object) -> None:
    with pytest.raises(InvalidOptionError, match="DebugOptions.memory_opt_level"):
        DebugOptions(memory_opt_level=level)  # type: ignore[arg-type]
