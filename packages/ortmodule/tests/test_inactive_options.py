"""A variable set to a value nothing installed acts on logs one WARNING (issue #13 item 4)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from ortmodule import ORTModule, inactive_options
from ortmodule.options import (
    NEEDS_COMPONENT,
    NO_EFFECT_IN_THIS_BUILD,
    VARIABLES,
    RuntimeOptions,
    inactive_variables,
)
from ortmodule_exporter import components


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(inactive_options, "_WARNED", set())
    # as if no component were installed, whatever this environment has
    monkeypatch.setattr(components, "_COMPONENTS", {})
    # and discovery done, so ORTModule registers none (alone, the first test would otherwise)
    monkeypatch.setattr(components, "_DISCOVERED", [True])
    yield


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_component_variable_without_its_component_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        model = ORTModule(torch.nn.Linear(4, 2))
        ORTModule(torch.nn.Linear(4, 2))
    (message,) = _warnings(caplog)
    assert message.startswith("ORTMODULE_MEMORY_OPT_LEVEL=1 has no effect")
    assert "pip install ortmodule-memory" in message
    model(torch.randn(3, 4)).sum().backward()  # and training goes on


def test_a_variable_a_component_honours_does_not_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_USE_TRITON", "1")
    components.register_component(
        components.Component(
            name="fake-triton",
            version="0",
            register=lambda: None,
            options=("ORTMODULE_USE_TRITON",),
        )
    )
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        ORTModule(torch.nn.Linear(4, 2))
    assert _warnings(caplog) == []


@pytest.mark.parametrize("name", sorted(NO_EFFECT_IN_THIS_BUILD))
def test_a_variable_nothing_builds_says_why(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    var = next(v for v in VARIABLES if v.name == name)
    monkeypatch.setenv(name, var.example)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        ORTModule(torch.nn.Linear(4, 2))
    (message,) = _warnings(caplog)
    assert message.startswith(f"{name}=") and NO_EFFECT_IN_THIS_BUILD[name] in message


def test_save_path_without_save_onnx_warns(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        ORTModule(torch.nn.Linear(4, 2))
    (message,) = _warnings(caplog)
    assert "DebugOptions(save_onnx=True" in message


def test_defaults_and_core_variables_are_quiet() -> None:
    # every variable at its example value: only the component and no-effect ones are named
    environ = {v.name: v.example for v in VARIABLES if v.name != "ORTMODULE_USE_FLASH_ATTENTION"}
    for needs_a_file in (
        "ORTMODULE_MEMORY_OPT_CONFIG",
        "ORTMODULE_TRITON_CONFIG_FILE",
        "ORTMODULE_SAVE_ONNX_PATH",
    ):
        environ.pop(needs_a_file, None)  # a component's is declared only where it is installed
    options = RuntimeOptions.resolve(environ=environ)
    named = {name for name, _ in inactive_variables(options)}
    expected = (set(NEEDS_COMPONENT) | set(NO_EFFECT_IN_THIS_BUILD)) & set(environ)
    assert named == expected
    assert inactive_variables(RuntimeOptions.defaults()) == []


def test_conv_algo_search_warns_on_the_cpu_engine_only() -> None:
    from ortmodule.options import RuntimeOptions, inactive_variables

    options = RuntimeOptions.resolve(environ={"ORTMODULE_CONV_ALGO_SEARCH": "EXHAUSTIVE"})
    ((name, message),) = inactive_variables(options, cuda_engine=False)
    assert name == "ORTMODULE_CONV_ALGO_SEARCH" and "CPU build" in message
    assert inactive_variables(options, cuda_engine=True) == []
