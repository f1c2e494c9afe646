"""``ortmodule doctor``: versions, the engine build, devices, settings and problems with fixes.

>>> import io
>>> from ortmodule.doctor import run_doctor
>>> run_doctor(io.StringIO(), environ={}) in (0, 1)  # 0 when no problem was found
True

Everything heavy (torch, onnxruntime) is imported inside the checks, so a broken install is
reported instead of stopping the report.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TextIO

__all__ = ["OPTIONAL_COMPONENTS", "Problem", "Report", "collect", "run_doctor"]

#: components ORTModule can use when installed: module name -> what it is for
OPTIONAL_COMPONENTS = {
    "triton": "Triton kernels (ORTMODULE_USE_TRITON)",
    "bitsandbytes": "QLoRA 4-bit MatMul export",
    "deepspeed": "ZeRO stage 3 (ORTMODULE_ENABLE_ZERO_STAGE3)",
}


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str


@dataclass
class Report:
    """The doctor's findings: ``(section, lines)`` in print order, problems and notes."""

    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def section(self, title: str) -> list[str]:
        lines: list[str] = []
        self.sections.append((title, lines))
        return lines

    def problem(self, what: str, fix: str) -> None:
        self.problems.append(Problem(what, fix))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _python(report: Report) -> None:
    lines = report.section("Python")
    lines.append(f"python {platform.python_version()} ({sys.executable})")
    lines.append(f"platform {platform.platform()}")
    for dist in ("torch", "onnx", "numpy"):
        version = _version(dist)
        lines.append(f"{dist} {version or 'NOT INSTALLED'}")
        if version is None:
            report.problem(f"{dist} is not installed", f"pip install {dist}")


def _ortmodule_packages(report: Report) -> None:
    lines = report.section("ORTModule packages")
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("ortmodule"):
            found.setdefault(name, dist.version)
    if not found:
        lines.append("none installed")
        report.problem("no ortmodule distribution is installed", "pip install 'ortmodule[cpu]'")
        return
    for name in sorted(found):
        lines.append(f"{name} {found[name]}")
    if len(set(found.values())) > 1:
        target = found.get("ortmodule", max(found.values()))
        stray = sorted(n for n, v in found.items() if v != target)
        report.problem(
            "ortmodule packages disagree on versions: "
            + ", ".join(f"{n} {found[n]}" for n in sorted(found)),
            "they move in lockstep; reinstall them at one version: pip install "
            + " ".join(f"'{n}=={target}'" for n in stray),
        )
    else:
        lines.append("versions agree")


def _engine(report: Report) -> dict[str, Any]:
    """The engine section; returns what later checks need (providers, build kind)."""
    from .debug_options import LogLevel
    from .engine_check import engine_problem, installed_engines
    from .log import suppress_output

    lines = report.section("Engine (ONNX Runtime)")
    engines = installed_engines()
    for dist, version in sorted(engines.items()):
        lines.append(f"distribution {dist} {version}")
    problem = engine_problem(engines)
    if problem:
        what, _, fix = problem.partition(". ")
        report.problem(what, fix or problem)
    info: dict[str, Any] = {"providers": [], "build": None}
    try:
        # held back: importing the engine can print (some wheels pull in DeepSpeed, which logs)
        with suppress_output(LogLevel.WARNING):
            from ortmodule_exporter.engine_binding import import_onnxruntime

            onnxruntime = import_onnxruntime()
            from onnxruntime.capi import _pybind_state
    except Exception as err:  # a broken wheel raises more than ImportError
        lines.append(f"import onnxruntime failed: {err}")
        if not problem:
            report.problem(
                f"onnxruntime cannot be imported ({err})",
                "reinstall the engine: pip install --force-reinstall 'ortmodule[cpu]' (or [cuda])",
            )
        return info
    providers = list(onnxruntime.get_available_providers())
    training = hasattr(_pybind_state, "TrainingAgent")
    cuda_build = "CUDAExecutionProvider" in providers or "onnxruntime-training" in engines
    info.update(providers=providers, build="CUDA" if cuda_build else "CPU")
    kind = f"{'CUDA' if cuda_build else 'CPU'} {'training' if training else 'inference-only'} build"
    lines.append(f"onnxruntime {onnxruntime.__version__}: {kind}")
    lines.append(f"training engine (TrainingAgent): {'available' if training else 'MISSING'}")
    lines.append("execution providers: " + ", ".join(providers))
    if not training and not problem:
        report.problem(
            "the installed onnxruntime has no training engine (no TrainingAgent)",
            "pip uninstall -y onnxruntime onnxruntime-gpu && pip install 'ortmodule[cpu]' (or [cuda])",
        )
    return info


def _devices(report: Report, engine: Mapping[str, Any]) -> None:
    lines = report.section("Devices")
    try:
        import torch
    except Exception as err:
        lines.append(f"import torch failed: {err}")
        report.problem(f"torch cannot be imported ({err})", "pip install --force-reinstall torch")
        return
    lines.append(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    if not torch.cuda.is_available():
        lines.append("cuda: not available (models run on cpu)")
        if engine.get("build") == "CUDA":
            report.notes.append(
                "the engine is the CUDA build but torch sees no CUDA device; only cpu is used"
            )
        return
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(
            f"cuda:{i} {torch.cuda.get_device_name(i)} (compute capability {major}.{minor})"
        )
    if "CUDAExecutionProvider" not in engine.get("providers", []):
        report.notes.append(
            "a CUDA device is present but the engine has no CUDA execution provider; models on cuda "
            "fall back to PyTorch. For GPU training: pip uninstall -y onnxruntime-training-cpu && "
            "pip install 'ortmodule[cuda]'"
        )


def _kernel_choice(report: Report) -> None:
    """Re-measure, on this machine, what ORTMODULE_KERNEL_CHOICE=AUTO decides at export."""
    lines = report.section("Kernel choice (ORTMODULE_KERNEL_CHOICE=AUTO, measured now)")
    from ortmodule_exporter.aten import kernel_choice as kc

    from .options import VARIABLES
    from .runner_config import kernel_choice_threads

    # the PyTorch side runs at the thread count it has inside the engine
    (var,) = [v for v in VARIABLES if v.name == "ORTMODULE_TORCH_THREADS_IN_ENGINE"]
    before = kc.current_torch_threads()
    kc.configure_kernel_choice(kc.current_mode(), kernel_choice_threads(var.default))
    try:
        _measure_kernels(lines)
    finally:
        kc.configure_kernel_choice(kc.current_mode(), before)


def _measure_kernels(lines: list[str]) -> None:
    from ortmodule_exporter.aten import kernel_choice as kc

    def gelu(n: int) -> Callable[[], tuple[float, float]]:
        return lambda: kc.measure_gelu(n)

    cases: list[tuple[str, Callable[[], tuple[float, float]]]] = [
        (f"GELU forward+backward, {n} float32 elements", gelu(n))
        for n in (1 << 14, kc.CALIBRATION_NUMEL)
    ]
    cases += [
        ("ReLU forward, 262144 float32 elements", lambda: kc.measure_relu(1 << 18)),
        ("ReLU backward, 262144 float32 elements", lambda: kc.measure_relu_backward(1 << 18)),
        (
            "Conv 3x3 16->32 forward+backward on 16x16x16x16",
            lambda: kc.measure_conv((16, 16, 16, 16), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1)),
        ),
        (
            "MaxPool 2x2 forward+backward on 16x16x32x32",
            lambda: kc.measure_max_pool2d((16, 16, 32, 32), (2, 2), (2, 2), (0, 0), (1, 1)),
        ),
        (
            "Bias gradient (a sum over 4096 rows of 256 float32)",
            lambda: kc.measure_row_sum(4096, 256),
        ),
    ]
    for label, measure in cases:
        try:
            engine_us, torch_us = measure()
        except Exception as err:  # an inference-only engine has no ...Grad: AUTO keeps its own
            lines.append(
                f"{label.split(' forward')[0]} could not be timed ({type(err).__name__}); "
                "the engine's kernel is used"
            )
            continue
        route = "PyTorch (ATen nodes)" if torch_us < engine_us else "the engine"
        lines.append(
            f"{label}: engine {engine_us:.0f} us, "
            f"PyTorch {torch_us:.0f} us with its ATen nodes -> {route}"
        )


def _threads(report: Report, environ: Mapping[str, str]) -> None:
    """How PyTorch and the engine share the cores (benchmarks/results/*-threads-*.md)."""
    import torch

    from .options import VARIABLES, InvalidOptionError, format_value

    lines = report.section("Threads")
    threads = torch.get_num_threads()
    lines.append(f"PyTorch intra-op threads: {threads} (the engine takes as many)")
    (var,) = [v for v in VARIABLES if v.name == "ORTMODULE_TORCH_THREADS_IN_ENGINE"]
    text = environ.get(var.name, "").strip()
    try:
        in_engine = format_value(var.convert(text) if text else var.default)
    except InvalidOptionError:
        in_engine = f"{text!r} (invalid, see Settings)"
    lines.append(
        f"PyTorch threads while the engine runs PyTorch-run nodes: {in_engine} "
        f"({var.name}; 0 keeps PyTorch's setting, AUTO measures 1 against it per graph)"
    )
    openmp = "OpenMP" in torch.__config__.parallel_info()
    policy = environ.get("OMP_WAIT_POLICY")
    if openmp and threads > 1 and (policy or "").upper() != "PASSIVE":
        report.notes.append(
            "PyTorch's OpenMP workers spin-wait after each operator "
            f"(OMP_WAIT_POLICY={policy or 'unset'}) and take cores from the engine's threads; "
            "OMP_WAIT_POLICY=PASSIVE, set before Python starts, took a GPT-style decoder on 2 "
            "cores from 1.44x to 1.05x eager's step time, but it changes eager's speed too: "
            "measure your own step before keeping it"
        )


def _components(report: Report) -> None:
    """Each component: its version, and whether it can work here (its own check says why not)."""
    from ortmodule_exporter.components import component_failures, load_components

    from .bundle import BUNDLED, status

    lines = report.section("Components")
    plugged = load_components()
    for bundled in BUNDLED:
        version, why = status(bundled)
        if why is None and bundled.dist in plugged:
            why = plugged[bundled.dist].problem()
        state = "usable here" if why is None else f"not usable here: {why}"
        lines.append(f"{bundled.dist} {version or '-'}: {state} ({bundled.summary})")
        if version is None:
            report.problem(f"{bundled.dist} is not installed", bundled.install)
    known = {b.dist for b in BUNDLED}
    for name, component in sorted(plugged.items()):
        if name in known:
            continue
        why = component.problem()
        state = "usable here" if why is None else f"not usable here: {why}"
        lines.append(f"{name} {component.version}: {state} ({component.summary})")
    for entry, error in sorted(component_failures().items()):
        lines.append(f"entry point {entry}: FAILED TO LOAD: {error}")
        report.problem(
            f"component entry point {entry} failed to load: {error}",
            "reinstall the component at the version of ortmodule, or uninstall it",
        )


def _optional(report: Report) -> dict[str, bool]:
    lines = report.section("Optional components")
    present = {}
    for name, purpose in OPTIONAL_COMPONENTS.items():
        try:
            present[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            present[name] = False
        state = f"installed {_version(name) or ''}".rstrip() if present[name] else "not installed"
        lines.append(f"{name}: {state} ({purpose})")
    return present


def _settings(report: Report, environ: Mapping[str, str], present: Mapping[str, bool]) -> None:
    from .options import (
        NEEDS_COMPONENT,
        VARIABLES,
        InvalidOptionError,
        RuntimeOptions,
        format_value,
        inactive_variables,
        unknown_variables,
    )

    lines = report.section("Settings (ORTMODULE_* environment variables)")
    values: dict[str, Any] = {}
    width = max(len(var.name) for var in VARIABLES)
    for var in VARIABLES:
        text = environ.get(var.name, "")
        if not text.strip():
            values[var.field] = var.default
            lines.append(f"{var.name:<{width}} = {format_value(var.default)} (default)")
            continue
        try:
            values[var.field] = var.convert(text)
        except InvalidOptionError as err:
            lines.append(f"{var.name:<{width}} = {text!r} (environment, INVALID)")
            report.problem(
                str(err),
                f"unset {var.name} (default {format_value(var.default)}) or set {var.accepted}",
            )
            continue
        lines.append(f"{var.name:<{width}} = {format_value(values[var.field])} (environment)")
    for name, close in unknown_variables(environ):
        report.problem(
            f"{name} is set but no ORTModule option reads it",
            f"did you mean {close}?"
            if close
            else f"unset {name}; see docs/options.md for the variables",
        )
    if all(var.field in values for var in VARIABLES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                RuntimeOptions.resolve(environ=environ)
            except InvalidOptionError as err:
                report.problem(str(err), "change the variables as the message says")
    if all(var.field in values for var in VARIABLES):
        # the same check ORTModule logs at wrap time: a set variable nothing installed acts on
        from ortmodule_exporter.components import handled_options, load_components

        from .inactive_options import cuda_engine

        load_components()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                options = RuntimeOptions.resolve(environ=environ)
            except InvalidOptionError:
                return
        for name, message in inactive_variables(options, handled_options(), cuda_engine()):
            package = NEEDS_COMPONENT.get(name)
            report.problem(
                message,
                f"pip install {package}" if package else f"unset {name}; it does nothing here",
            )


def collect(environ: Mapping[str, str] = os.environ) -> Report:
    """Run every check; a check that crashes becomes a problem instead of stopping the others."""
    report = Report()
    engine: dict[str, Any] = {}
    present: dict[str, bool] = {}

    def guarded(title: str, check: Callable[[], Any]) -> Any:
        try:
            return check()
        except Exception as err:
            report.problem(
                f"the doctor could not check {title}: {type(err).__name__}: {err}", "report this"
            )
            return None

    guarded("Python", lambda: _python(report))
    guarded("ortmodule packages", lambda: _ortmodule_packages(report))
    engine = guarded("the engine", lambda: _engine(report)) or engine
    guarded("devices", lambda: _devices(report, engine))
    guarded("components", lambda: _components(report))
    guarded("threads", lambda: _threads(report, environ))
    if engine.get("build"):
        guarded("kernel choice", lambda: _kernel_choice(report))
    present = guarded("optional components", lambda: _optional(report)) or present
    guarded("settings", lambda: _settings(report, environ, present))
    return report


def run_doctor(stream: TextIO = sys.stdout, environ: Mapping[str, str] = os.environ) -> int:
    """Print the report to ``stream``; 0 when no problem was found, else 1."""
    report = collect(environ)
    out = [f"ortmodule doctor ({platform.node() or 'this machine'})"]
    for title, lines in report.sections:
        out.append("")
        out.append(f"{title}:")
        out.extend(f"  {line}" for line in lines)
    if report.notes:
        out.append("")
        out.append("Notes:")
        out.extend(f"  - {note}" for note in report.notes)
    out.append("")
    if report.problems:
        out.append(f"Problems ({len(report.problems)}):")
        for p in report.problems:
            out.append(f"  - {p.what}")
            out.append(f"    fix: {p.fix}")
    else:
        out.append("No problems found.")
    stream.write("\n".join(out) + "\n")
    stream.flush()
    return 1 if report.problems else 0
