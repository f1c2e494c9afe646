"""The meta-package: its components' names import from ``ortmodule``; the doctor lists them."""

from __future__ import annotations

import io
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

import ortmodule
import ortmodule_optim
import ortmodule_sampler
from ortmodule import bundle
from ortmodule.doctor import run_doctor

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_component_names_are_the_components_own_objects() -> None:
    from ortmodule import (
        FP16_Optimizer,
        FusedAdam,
        LoadBalancingDistributedBatchSampler,
        LoadBalancingDistributedSampler,
    )

    assert FusedAdam is ortmodule_optim.FusedAdam
    assert FP16_Optimizer is ortmodule_optim.FP16_Optimizer
    assert LoadBalancingDistributedSampler is ortmodule_sampler.LoadBalancingDistributedSampler
    assert (
        LoadBalancingDistributedBatchSampler
        is ortmodule_sampler.LoadBalancingDistributedBatchSampler
    )
    assert set(bundle.exports()) <= set(ortmodule.__all__) <= set(dir(ortmodule))
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        ortmodule.NotAThing  # noqa: B018


def test_every_bundled_component_is_a_pinned_dependency() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    for component in bundle.BUNDLED:
        assert f"{component.dist}=={project['version']}" in reqs, component.dist


def test_a_missing_component_names_the_distribution_to_install() -> None:
    # a child process where ortmodule_sampler cannot be imported, as after installing without it
    code = (
        "import sys; sys.modules['ortmodule_sampler'] = None\n"
        "try:\n"
        "    from ortmodule import LoadBalancingDistributedSampler\n"
        "except ImportError as err:\n"
        "    print(type(err).__name__, err)\n"
        "from ortmodule import FusedAdam\n"
        "print('optim ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "optim ok" in out.stdout
    assert "pip install ortmodule-sampler" in out.stdout, out.stdout + out.stderr


def test_the_names_come_from_the_components_entry_points() -> None:
    # each component's pyproject.toml offers its names; the meta-package imports no module by name
    offered = {name: ep.value for name, ep in bundle.exports().items()}
    assert offered["FusedAdam"] == "ortmodule_optim:FusedAdam"
    assert offered["LoadBalancingDistributedSampler"] == (
        "ortmodule_sampler:LoadBalancingDistributedSampler"
    )
    promised = set(ortmodule.__all__) - set(vars(ortmodule))
    assert promised <= set(offered), "ortmodule.__all__ names something no component offers"


def test_a_promised_name_without_any_component_names_the_extra() -> None:
    code = (
        "from importlib import metadata\n"
        "import ortmodule.bundle as b\n"
        "b.exports = lambda: {}\n"
        "try:\n"
        "    from ortmodule import FusedAdam\n"
        "except ImportError as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "MissingComponentError" in out.stdout and "ortmodule[cpu]" in out.stdout, out.stdout


def test_doctor_lists_each_component_with_its_version_and_state() -> None:
    out = io.StringIO()
    run_doctor(stream=out, environ={})
    text = out.getvalue()
    section = text[text.index("Components:") :].split("\n\n")[0]
    for component in bundle.BUNDLED:
        version = metadata.version(component.dist)
        assert f"{component.dist} {version}: usable here" in section, section


def test_doctor_reports_a_component_whose_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from ortmodule_exporter import components

    zero = components.load_components()["ortmodule-zero"]
    monkeypatch.setitem(
        components._COMPONENTS,
        "ortmodule-zero",
        components.Component(
            zero.name, zero.version, zero.register, zero.options, lambda: "needs DeepSpeed"
        ),
    )
    out = io.StringIO()
    run_doctor(stream=out, environ={})
    assert "ortmodule-zero 0.1.0: not usable here: needs DeepSpeed" in out.getvalue()
