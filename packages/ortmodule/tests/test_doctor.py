"""``ortmodule doctor`` on this machine, and the problems it reports with their fixes."""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import onnxruntime
import pytest
import torch

from ortmodule import doctor, engine_check
from ortmodule.doctor import OPTIONAL_COMPONENTS, run_doctor


def _doctor(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    out = io.StringIO()
    status = run_doctor(stream=out, environ={} if environ is None else environ)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def clean() -> tuple[int, str]:
    return _doctor()


def test_reports_versions_engine_and_packages(clean: tuple[int, str]) -> None:
    status, text = clean
    assert f"torch {torch.__version__}" in text
    assert f"onnx {metadata.version('onnx')}" in text
    assert f"numpy {metadata.version('numpy')}" in text
    assert f"onnxruntime {onnxruntime.__version__}" in text
    assert "training engine (TrainingAgent): available" in text
    assert "execution providers: " + ", ".join(onnxruntime.get_available_providers()) in text
    assert f"ortmodule {metadata.version('ortmodule')}" in text
    assert f"ortmodule-exporter {metadata.version('ortmodule-exporter')}" in text
    assert "python 3." in text


@pytest.mark.skipif(
    "CUDAExecutionProvider" in onnxruntime.get_available_providers(),
    reason="this machine has the CUDA build",
)
def test_reports_the_cpu_engine_build(clean: tuple[int, str]) -> None:
    status, text = clean
    assert "CPU training build" in text
    assert (
        f"distribution onnxruntime-training-cpu {metadata.version('onnxruntime-training-cpu')}"
        in text
    )


def test_reports_the_kernel_choice_it_measures(clean: tuple[int, str]) -> None:
    _, text = clean
    assert "Kernel choice (ORTMODULE_KERNEL_CHOICE=AUTO, measured now):" in text
    assert text.count("GELU forward+backward") == 2 and "-> " in text


def test_reports_threads_and_names_the_openmp_wait_policy() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, spinning = _doctor({"ORTMODULE_TORCH_THREADS_IN_ENGINE": "0"})
        _, passive = _doctor({"OMP_WAIT_POLICY": "passive"})
    finally:
        torch.set_num_threads(before)
    assert "PyTorch intra-op threads: 2 (the engine takes as many)" in spinning
    assert "PyTorch threads while the engine runs PyTorch-run nodes: 0" in spinning
    assert "PyTorch threads while the engine runs PyTorch-run nodes: AUTO" in passive
    assert "OMP_WAIT_POLICY=unset" in spinning
    assert "OMP_WAIT_POLICY=" not in passive


def test_reports_devices(clean: tuple[int, str]) -> None:
    _, text = clean
    if torch.cuda.is_available():
        assert f"cuda:0 {torch.cuda.get_device_name(0)}" in text
    else:
        assert "cuda: not available" in text


def test_reports_each_optional_component(clean: tuple[int, str]) -> None:
    _, text = clean
    for name in ("triton", "bitsandbytes", "deepspeed"):
        assert name in OPTIONAL_COMPONENTS
        installed = importlib.util.find_spec(name) is not None
        line = next(line for line in text.splitlines() if line.strip().startswith(f"{name}:"))
        assert ("not installed" not in line) == installed, line


def test_reports_every_setting_with_its_source(clean: tuple[int, str]) -> None:
    _, text = clean
    assert "ORTMODULE_LOG_LEVEL" in text and "= WARNING (default)" in text
    _, text = _doctor({"ORTMODULE_ONNX_OPSET_VERSION": "15"})
    assert any(
        line.split() == ["ORTMODULE_ONNX_OPSET_VERSION", "=", "15", "(environment)"]
        for line in text.splitlines()
    )


def test_no_problems_on_this_machine(clean: tuple[int, str]) -> None:
    status, text = clean
    assert "No problems found." in text, text
    assert status == 0


def test_invalid_variable_is_a_problem_with_its_fix() -> None:
    status, text = _doctor(
        {"ORTMODULE_ONNX_OPSET_VERSION": "99", "ORTMODULE_FALLBACK_RETRY": "maybe"}
    )
    assert status == 1
    assert "Problems (2):" in text
    assert (
        "ORTMODULE_ONNX_OPSET_VERSION='99' is invalid (out of range); accepted: an integer from 14 to 20"
        in text
    )
    assert (
        "fix: unset ORTMODULE_ONNX_OPSET_VERSION (default 17) or set an integer from 14 to 20"
        in text
    )
    assert "ORTMODULE_FALLBACK_RETRY='maybe' is invalid" in text


def test_unknown_variable_and_cross_check_are_problems() -> None:
    status, text = _doctor({"ORTMODULE_LOGLEVEL": "INFO"})
    assert status == 1 and "ORTMODULE_LOGLEVEL is set but no ORTModule option reads it" in text
    assert "fix: did you mean ORTMODULE_LOG_LEVEL?" in text
    status, text = _doctor({"ORTMODULE_USE_FLASH_ATTENTION": "1"})
    from ortmodule.options import VARIABLES

    if "ORTMODULE_USE_FLASH_ATTENTION" in {var.name for var in VARIABLES}:
        assert status == 1 and "needs ORTMODULE_USE_TRITON=1" in text
    else:  # ortmodule-triton, which declares both and the check, is not installed here
        assert status == 1 and "fix: pip install ortmodule-triton" in text


def test_feature_without_its_component_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fix names the ORTModule component that acts on the variable, not a bare dependency
    from ortmodule_exporter import components

    monkeypatch.setattr(components, "handled_options", lambda: frozenset())
    status, text = _doctor({"ORTMODULE_USE_TRITON": "1"})
    assert status == 1
    assert (
        "ORTMODULE_USE_TRITON=1 has no effect: no installed component honours it" in text
        and "fix: pip install ortmodule-triton" in text
    )


@pytest.mark.parametrize(
    ("found", "fix"),
    [
        ({}, "pip install 'ortmodule[cpu]'"),
        ({"onnxruntime": "1.19.2"}, "inference-only build"),
        (
            {"onnxruntime-training-cpu": "1.19.2", "onnxruntime-training": "1.19.2"},
            "pip uninstall -y onnxruntime-training-cpu onnxruntime-training",
        ),
    ],
)
def test_engine_install_problems_name_the_pip_command(
    found: dict[str, str], fix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_check, "installed_engines", lambda: dict(found))
    status, text = _doctor()
    assert status == 1
    problems = text[text.index("Problems") :]
    assert fix in problems, problems


def test_version_disagreement_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    class Dist:
        def __init__(self, name: str, version: str) -> None:
            self.metadata = {"Name": name}
            self.version = version

    fake = [
        Dist("ortmodule", "0.2.0"),
        Dist("ortmodule_exporter", "0.1.0"),
        Dist("torch", "2.13.0"),
    ]
    monkeypatch.setattr(doctor.metadata, "distributions", lambda: fake)
    status, text = _doctor()
    assert status == 1
    assert (
        "ortmodule packages disagree on versions: ortmodule 0.2.0, ortmodule-exporter 0.1.0" in text
    )
    assert "pip install 'ortmodule-exporter==0.2.0'" in text


def test_a_crashing_check_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any) -> None:
        raise RuntimeError("broken metadata")

    monkeypatch.setattr(doctor.metadata, "distributions", boom)
    status, text = _doctor()
    assert status == 1
    assert "the doctor could not check ortmodule packages: RuntimeError: broken metadata" in text
    assert "Settings (ORTMODULE_* environment variables):" in text  # the other checks still ran
