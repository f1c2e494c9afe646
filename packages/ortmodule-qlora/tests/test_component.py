"""The component is found through its entry point, says why it is idle without bitsandbytes and
registers without importing it."""

from __future__ import annotations

import importlib.metadata
import subprocess
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
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # find_spec now finds nothing
    problem = check()
    assert problem is not None
    assert "bitsandbytes is not installed" in problem and "ortmodule-qlora[bnb]" in problem


def test_registering_the_component_does_not_import_bitsandbytes() -> None:
    """bitsandbytes costs seconds at import; the component waits for a model that uses it."""
    code = (
        "import sys\n"
        "from ortmodule_exporter.components import register_component\n"
        "from ortmodule_qlora import COMPONENT\n"
        "assert COMPONENT.problem() is None\n"
        "register_component(COMPONENT)\n"
        "print('bitsandbytes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
