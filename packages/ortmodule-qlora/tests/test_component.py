"""The component is found through its entry point and says why it is idle without bitsandbytes."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from ortmodule_qlora import COMPONENT
from ortmodule_qlora.component import check


def test_entry_point_names_the_component() -> None:
    (ep,) = [
        e
        for e in importlib.metadata.entry_points(group="ortmodule.components")
        if e.name == "qlora"
    ]
    assert ep.load() is COMPONENT
    assert COMPONENT.problem() is None  # bitsandbytes is installed in the test environment


def test_check_names_the_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import now fails
    problem = check()
    assert problem is not None
    assert "bitsandbytes cannot be imported" in problem and "ortmodule-qlora[bnb]" in problem
