"""A component is a folder: a toy one, installed from a temporary folder, declares a variable
and a pass, and the runtime parses, documents, warns about and hands on its variable with no
edit anywhere else (issue #39 item 1)."""

from __future__ import annotations

import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ortmodule import ORTModule
from ortmodule.options import (
    InvalidOptionError,
    RuntimeOptions,
    inactive_variables,
    unknown_variables,
    variables,
    variables_markdown,
)
from ortmodule.runner_config import export_config
from ortmodule_exporter import components, unregister_post_export_pass

TOY = """
from ortmodule_exporter import register_post_export_pass
from ortmodule_exporter.components import Component
from ortmodule_exporter.option import Option, int_in

SEEN = []

TOY_LEVEL = Option(
    "ORTMODULE_TOY_LEVEL", "int", 0, int_in(0, 3), "0 to 3", "toy-component",
    "How much the toy does.", "2", keeps_engine_nodes="the toy (ORTMODULE_TOY_LEVEL)",
)


def _toy_pass(exported, options):
    SEEN.append(options.get("ORTMODULE_TOY_LEVEL"))


def _register():
    register_post_export_pass("toy.pass", _toy_pass, order=500)


COMPONENT = Component(
    name="toy-component", version="0.1.0", register=_register, options=(TOY_LEVEL,),
)
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The toy distribution on ``sys.path``: a module and a dist-info naming its entry point."""
    components.load_components()  # the installed components, before the toy is on the path
    (tmp_path / "toy_component.py").write_text(textwrap.dedent(TOY))
    info = tmp_path / "toy_component-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-component\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[ortmodule.components]\ntoy = toy_component:COMPONENT\n"
    )
    monkeypatch.delitem(sys.modules, "toy_component", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    # discovery runs again (the components already registered stay as they are)
    monkeypatch.setattr(components, "_COMPONENTS", dict(components._COMPONENTS))
    monkeypatch.setattr(components, "_DISCOVERED", [False])
    yield
    unregister_post_export_pass("toy.pass")


def test_the_runtime_parses_and_documents_a_toy_components_variable(toy: None) -> None:
    assert "ORTMODULE_TOY_LEVEL" in {var.name for var in variables()}
    options = RuntimeOptions.resolve(environ={"ORTMODULE_TOY_LEVEL": "2"})
    assert options.toy_level == 2 and options.source("toy_level") == "environment"
    assert RuntimeOptions.defaults().toy_level == 0
    # what it needs of the graph: the engine's own nodes, so the speed defaults step aside
    # (the kernel choice decides only the loss)
    assert export_config(options).kernel_choice == "losses"
    assert export_config(RuntimeOptions.defaults()).kernel_choice == "auto"
    with pytest.raises(InvalidOptionError, match=r"ORTMODULE_TOY_LEVEL='9' is invalid.*0 to 3"):
        RuntimeOptions.resolve(environ={"ORTMODULE_TOY_LEVEL": "9"})
    assert unknown_variables({"ORTMODULE_TOY_LEVEL": "1"}) == []
    row = next(line for line in variables_markdown().splitlines() if "ORTMODULE_TOY_LEVEL" in line)
    assert "toy-component when installed (else a warning)" in row
    assert "How much the toy does." in row


def test_an_unregistered_toy_component_is_named_in_the_warning(
    toy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(components, "_COMPONENTS", {})
    options = RuntimeOptions.resolve(environ={"ORTMODULE_TOY_LEVEL": "1"})
    ((name, message),) = inactive_variables(options)
    assert name == "ORTMODULE_TOY_LEVEL"
    assert message.endswith("install toy-component (pip install toy-component).")


def test_the_toy_pass_reads_its_variable_through_ortmodule(
    toy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_TOY_LEVEL", "3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ORTModule(torch.nn.Linear(4, 2))
    assert not [w for w in caught if "ORTMODULE_TOY_LEVEL" in str(w.message)]  # not unknown
    model(torch.randn(3, 4)).sum().backward()
    assert "toy-component" in components.loaded_components()
    seen = sys.modules["toy_component"].SEEN
    assert seen and set(seen) == {3}
    # and it counts as honoured: nothing warns about it
    assert inactive_variables(model.options, components.handled_options()) == []
