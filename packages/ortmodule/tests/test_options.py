"""RuntimeOptions: defaults, then DebugOptions, then ORTMODULE_* variables; every variable parsed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import BARE_PACKAGES

from ortmodule.bundle import COMPONENT_VARIABLES
from ortmodule.debug_options import DebugOptions, LogLevel
from ortmodule.options import (
    DEFAULT_FALLBACK_POLICY,
    RUNTIME_VARIABLES,
    VARIABLES,
    FallbackPolicy,
    InvalidOptionError,
    RuntimeOptions,
    SkipCheck,
    format_value,
    unknown_variables,
)

FP = FallbackPolicy
BY_NAME = {var.name: var for var in VARIABLES}


@pytest.fixture
def a_file(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text("{}")
    return str(path)


def _valid(tmp: str, a_file: str) -> dict[str, list[tuple[str, Any]]]:
    """Accepted spellings of every variable and the value each resolves to."""
    on_off = [
        ("1", True),
        ("0", False),
        ("true", True),
        ("False", False),
        ("yes", True),
        ("OFF", False),
    ]
    return {
        "ORTMODULE_ONNX_OPSET_VERSION": [("14", 14), ("17", 17), (" 20 ", 20)],
        "ORTMODULE_FALLBACK_POLICY": [
            ("FALLBACK_DISABLE", FP.FALLBACK_DISABLE),
            (
                "FALLBACK_UNSUPPORTED_DEVICE|FALLBACK_UNSUPPORTED_DATA",
                FP.FALLBACK_UNSUPPORTED_DEVICE | FP.FALLBACK_UNSUPPORTED_DATA,
            ),
            (
                "fallback_force_torch_forward | FALLBACK_FORCE_TORCH_BACKWARD",
                FP.FALLBACK_FORCE_TORCH_FORWARD | FP.FALLBACK_FORCE_TORCH_BACKWARD,
            ),
            ("FALLBACK_BAD_INITIALIZATION", FP.FALLBACK_BAD_INITIALIZATION),
            ("FALLBACK_UNSUPPORTED_TORCH_MODEL", FP.FALLBACK_UNSUPPORTED_TORCH_MODEL),
            ("FALLBACK_UNSUPPORTED_ONNX_MODEL", FP.FALLBACK_UNSUPPORTED_ONNX_MODEL),
        ],
        "ORTMODULE_FALLBACK_RETRY": on_off,
        "ORTMODULE_LOG_LEVEL": [(level.name, level) for level in LogLevel]
        + [("devinfo", LogLevel.DEVINFO)],
        "ORTMODULE_SAVE_ONNX_PATH": [
            (tmp, tmp),
            (os.path.join(tmp, "new"), os.path.join(tmp, "new")),
        ],
        "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": on_off,
        "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": on_off,
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": on_off,
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER": on_off,
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": on_off,
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER": on_off,
        "ORTMODULE_PRINT_INPUT_DENSITY": on_off,
        "ORTMODULE_PRINT_MEMORY_STATS": on_off,
        "ORTMODULE_CACHE_DIR": [(tmp, tmp), ("~/cache", os.path.expanduser("~/cache"))],
        "ORTMODULE_USE_EFFICIENT_ATTENTION": on_off,
        "ORTMODULE_ATEN_SDPA_FALLBACK": on_off,
        "ORTMODULE_ATEN_DROPOUT": on_off,
        "ORTMODULE_FUSED_ATTENTION": on_off,
        "ORTMODULE_KERNEL_CHOICE": [("auto", "AUTO"), ("Engine", "ENGINE"), ("TORCH", "TORCH")],
        "ORTMODULE_EXPORTER": [("torchscript", "torchscript"), ("Torch_Export", "torch_export")],
        "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": on_off,
        "ORTMODULE_MEMORY_OPT_LEVEL": [("0", 0), ("1", 1), ("2", 2)],
        "ORTMODULE_MEMORY_OPT_CONFIG": [(a_file, a_file)],
        "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": on_off,
        "ORTMODULE_ENABLE_ZERO_STAGE3": on_off,
        "ORTMODULE_TORCH_THREADS_IN_ENGINE": [
            ("0", "0"),
            ("1", "1"),
            (" 4 ", "4"),
            ("auto", "AUTO"),
        ],
        "ORTMODULE_CPU_MEM_ARENA": [("auto", "AUTO"), ("1", "1"), ("0", "0")],
        "ORTMODULE_CONV_ALGO_SEARCH": [
            ("HEURISTIC", "HEURISTIC"),
            ("exhaustive", "EXHAUSTIVE"),
            ("DEFAULT", "DEFAULT"),
        ],
        "ORTMODULE_SKIPCHECK_POLICY": [
            ("SKIP_CHECK_DISABLED", SkipCheck.SKIP_CHECK_DISABLED),
            (
                "SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT|SKIP_CHECK_EXECUTION_AGENT",
                SkipCheck.SKIP_CHECK_DEVICE
                | SkipCheck.SKIP_CHECK_BUILD_GRADIENT
                | SkipCheck.SKIP_CHECK_EXECUTION_AGENT,
            ),
        ],
        "ORTMODULE_USE_TRITON": on_off,
        "ORTMODULE_TRITON_CONFIG_FILE": [(a_file, a_file)],
        "ORTMODULE_TRITON_DEBUG": on_off,
        "ORTMODULE_ENABLE_TUNING": on_off,
        "ORTMODULE_MAX_TUNING_DURATION_MS": [("1", 1), ("9999", 9999)],
        "ORTMODULE_TUNING_RESULTS_PATH": [(tmp, tmp)],
        "ORTMODULE_USE_FLASH_ATTENTION": on_off,
    }


def _invalid(a_file: str, tmp: str) -> dict[str, list[str]]:
    """Rejected values of every variable."""
    switch = ["2", "enable", "-1"]
    return {
        "ORTMODULE_ONNX_OPSET_VERSION": ["13", "21", "17.0", "latest"],
        "ORTMODULE_FALLBACK_POLICY": [
            "FALLBACK_NEVER",
            "FALLBACK_DISABLE|FALLBACK_UNSUPPORTED_DATA",
            "A||B",
            "7",
        ],
        "ORTMODULE_FALLBACK_RETRY": switch,
        "ORTMODULE_LOG_LEVEL": ["DEBUG", "3", "WARN"],
        "ORTMODULE_SAVE_ONNX_PATH": [a_file],
        "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": switch,
        "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": switch,
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": switch,
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER": switch,
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": switch,
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER": switch,
        "ORTMODULE_PRINT_INPUT_DENSITY": switch,
        "ORTMODULE_PRINT_MEMORY_STATS": switch,
        "ORTMODULE_CACHE_DIR": [a_file],
        "ORTMODULE_USE_EFFICIENT_ATTENTION": switch,
        "ORTMODULE_ATEN_SDPA_FALLBACK": switch,
        "ORTMODULE_ATEN_DROPOUT": switch,
        "ORTMODULE_FUSED_ATTENTION": switch,
        "ORTMODULE_KERNEL_CHOICE": ["fastest", "1"],
        "ORTMODULE_EXPORTER": ["dynamo", "torch-export", "1"],
        "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": switch,
        "ORTMODULE_MEMORY_OPT_LEVEL": ["3", "-1", "high"],
        "ORTMODULE_MEMORY_OPT_CONFIG": [os.path.join(tmp, "missing.json"), tmp],
        "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": switch,
        "ORTMODULE_ENABLE_ZERO_STAGE3": switch,
        "ORTMODULE_TORCH_THREADS_IN_ENGINE": ["-1", "two", "1.5"],
        "ORTMODULE_CONV_ALGO_SEARCH": ["FAST", "1"],
        "ORTMODULE_CPU_MEM_ARENA": ["on", "2"],
        "ORTMODULE_SKIPCHECK_POLICY": [
            "SKIP_CHECK_NOTHING",
            "SKIP_CHECK_DISABLED|SKIP_CHECK_DEVICE",
        ],
        "ORTMODULE_USE_TRITON": switch,
        "ORTMODULE_TRITON_CONFIG_FILE": [os.path.join(tmp, "missing.json")],
        "ORTMODULE_TRITON_DEBUG": switch,
        "ORTMODULE_ENABLE_TUNING": switch,
        "ORTMODULE_MAX_TUNING_DURATION_MS": ["0", "-5", "10s"],
        "ORTMODULE_TUNING_RESULTS_PATH": [],  # any path is accepted; written or read later
        "ORTMODULE_USE_FLASH_ATTENTION": switch,
    }


def _installed(cases: dict[str, Any]) -> dict[str, Any]:
    """The cases of the variables declared here: a component that is not installed declares none
    (its own tests parse them; the dev environment has every component)."""
    return {name: value for name, value in cases.items() if name in BY_NAME}


def _resolve(env: dict[str, str]) -> RuntimeOptions:
    if env.get("ORTMODULE_USE_FLASH_ATTENTION", "0").lower() in ("1", "true", "yes", "on"):
        env = {**env, "ORTMODULE_USE_TRITON": "1"}  # flash attention needs triton; tested below
    return RuntimeOptions.resolve(environ=env)


def test_cases_cover_every_variable(tmp_path: Path, a_file: str) -> None:
    names = {var.name for var in VARIABLES}
    for cases in (_valid(str(tmp_path), a_file), _invalid(a_file, str(tmp_path))):
        assert set(cases) >= names
        # the rest belong to components that are not installed here
        assert set(cases) - names <= set(COMPONENT_VARIABLES)


def test_fields_are_the_variables_plus_debug_options() -> None:
    names = {f.name for f in dataclasses.fields(RuntimeOptions)}
    names -= {"sources", "components", "unclaimed"}
    assert names == {var.field for var in RUNTIME_VARIABLES} | {"save_onnx", "onnx_prefix"}
    assert all(var.name == "ORTMODULE_" + var.field.upper() for var in VARIABLES)
    # a component's variable is read like the runtime's own
    defaults = RuntimeOptions.defaults()
    components = {var.field for var in VARIABLES} - {var.field for var in RUNTIME_VARIABLES}
    assert {field for field, _ in defaults.components} == components
    for field in components:
        assert getattr(defaults, field) == BY_NAME["ORTMODULE_" + field.upper()].default
    with pytest.raises(AttributeError, match="no attribute 'not_a_variable'"):
        defaults.not_a_variable  # noqa: B018


def test_defaults_as_the_guide_says() -> None:
    o = RuntimeOptions.defaults()
    assert o.log_level is LogLevel.WARNING and not o.save_onnx and o.onnx_prefix == ""
    assert o.onnx_opset_version == 17
    assert (
        o.fallback_policy
        == DEFAULT_FALLBACK_POLICY
        == (
            FP.FALLBACK_UNSUPPORTED_DEVICE
            | FP.FALLBACK_UNSUPPORTED_DATA
            | FP.FALLBACK_UNSUPPORTED_TORCH_MODEL
            | FP.FALLBACK_UNSUPPORTED_ONNX_MODEL
        )
    )
    assert (
        o.enable_compute_optimizer,
        o.enable_sparse_optimizer,
        o.deepcopy_before_model_export,
    ) == (True,) * 3
    assert o.enable_custom_autograd and not o.allow_autograd_checkpoint
    assert not (o.enable_embedding_sparse_optimizer or o.print_input_density)
    assert o.cache_dir is None and o.save_onnx_path is None
    assert not (o.use_efficient_attention or o.fallback_retry)
    # the components' variables, where installed (each component's defaults are off)
    components = {
        "print_memory_stats": False,
        "memory_opt_level": 0,
        "use_triton": False,
        "use_flash_attention": False,
        "enable_tuning": False,
        "enable_mem_efficient_grad_mgmt": False,
        "enable_zero_stage3": False,
    }
    for field, off in components.items():
        if "ORTMODULE_" + field.upper() in BY_NAME:
            assert getattr(o, field) == off, field
    assert o.skipcheck_policy == SkipCheck.SKIP_CHECK_DISABLED and o.conv_algo_search == "HEURISTIC"
    for var in VARIABLES:
        assert getattr(o, var.field) == var.default, var.name
        assert o.source(var.field) == "default"


def test_every_valid_value(tmp_path: Path, a_file: str) -> None:
    for name, cases in _installed(_valid(str(tmp_path), a_file)).items():
        field = BY_NAME[name].field
        for text, expected in cases:
            o = _resolve({name: text})
            assert getattr(o, field) == expected, (name, text)
            assert o.source(field) == "environment"


def test_every_invalid_value_names_variable_value_and_accepted(tmp_path: Path, a_file: str) -> None:
    for name, bad_values in _installed(_invalid(a_file, str(tmp_path))).items():
        for bad in bad_values:
            with pytest.raises(InvalidOptionError) as info:
                _resolve({name: bad})
            message = str(info.value)
            assert name in message and repr(bad) in message, message
            assert BY_NAME[name].accepted in message, message
            assert isinstance(info.value, ValueError)


def test_opset_range_matches_the_exporter() -> None:
    export = pytest.importorskip("ortmodule_exporter.export")
    from ortmodule import options

    assert (options.MIN_OPSET, options.MAX_OPSET, options.DEFAULT_OPSET) == (
        export.MIN_OPSET,
        export.MAX_OPSET,
        export.DEFAULT_OPSET,
    )


def test_precedence_default_then_debug_options_then_environment() -> None:
    debug = DebugOptions(log_level=LogLevel.INFO, save_onnx=True, onnx_prefix="m")
    o = RuntimeOptions.resolve(debug, environ={})
    assert (o.log_level, o.save_onnx, o.onnx_prefix) == (LogLevel.INFO, True, "m")
    assert o.source("log_level") == o.source("save_onnx") == "DebugOptions"
    assert o.source("cache_dir") == "default"

    o = RuntimeOptions.resolve(
        debug, environ={"ORTMODULE_LOG_LEVEL": "ERROR", "ORTMODULE_SAVE_ONNX_PATH": "/tmp/x"}
    )
    assert o.log_level is LogLevel.ERROR and o.source("log_level") == "environment"
    assert (
        o.save_onnx and o.save_onnx_path == "/tmp/x" and o.source("save_onnx_path") == "environment"
    )

    o = RuntimeOptions.resolve(None, environ={"ORTMODULE_LOG_LEVEL": "VERBOSE"})
    assert o.log_level is LogLevel.VERBOSE and o.source("save_onnx") == "default"


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "16")
    assert RuntimeOptions.resolve().onnx_opset_version == 16


def test_empty_value_counts_as_unset() -> None:
    o = RuntimeOptions.resolve(
        environ={"ORTMODULE_CACHE_DIR": "", "ORTMODULE_ONNX_OPSET_VERSION": "  "}
    )
    assert o.cache_dir is None and o.onnx_opset_version == 17 and o.source("cache_dir") == "default"


def test_flash_attention_needs_triton() -> None:
    if "ORTMODULE_USE_FLASH_ATTENTION" not in BY_NAME:
        pytest.skip("ortmodule-triton (which declares the variables) is not installed")
    with pytest.raises(
        InvalidOptionError, match="ORTMODULE_USE_FLASH_ATTENTION=1 needs ORTMODULE_USE_TRITON=1"
    ):
        RuntimeOptions.resolve(environ={"ORTMODULE_USE_FLASH_ATTENTION": "1"})
    o = RuntimeOptions.resolve(
        environ={"ORTMODULE_USE_FLASH_ATTENTION": "1", "ORTMODULE_USE_TRITON": "1"}
    )
    assert o.use_flash_attention and o.use_triton


def test_unknown_variable_warns_with_the_closest_name() -> None:
    env = {"ORTMODULE_CACHEDIR": "/tmp", "ORTMODULE_ZZZ": "1", "OTHER": "1"}
    assert unknown_variables(env) == [
        ("ORTMODULE_CACHEDIR", "ORTMODULE_CACHE_DIR"),
        ("ORTMODULE_ZZZ", None),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RuntimeOptions.resolve(environ=env)
    assert [str(w.message) for w in caught] == [
        "ORTMODULE_CACHEDIR is not an ORTModule option and is ignored; did you mean ORTMODULE_CACHE_DIR?",
        "ORTMODULE_ZZZ is not an ORTModule option and is ignored",
    ]
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RuntimeOptions.resolve(environ={"ORTMODULE_CACHE_DIR": "/tmp"})


def test_a_component_variable_without_its_component_is_no_unknown_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ortmodule.options import inactive_variables
    from ortmodule_exporter import components

    # as if no component were installed: nothing declares the variable, the bundle names it
    monkeypatch.setattr(components, "declared_options", lambda: ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = RuntimeOptions.resolve(
            DebugOptions(memory_opt_level=1),
            environ={"ORTMODULE_USE_TRITON": "1", "ORTMODULE_ENABLE_TUNING": "0"},
        )
    assert not hasattr(options, "use_triton")
    assert inactive_variables(options) == [
        (
            "DebugOptions.memory_opt_level",
            "DebugOptions.memory_opt_level=1 has no effect: no installed component declares it; "
            "install the component it is for.",
        ),
        (
            "ORTMODULE_USE_TRITON",
            "ORTMODULE_USE_TRITON=1 has no effect: no installed component honours it; "
            "install ortmodule-triton (pip install ortmodule-triton).",
        ),
    ]


def test_the_bundle_names_what_the_installed_components_declare() -> None:
    from ortmodule_exporter.components import declared_options

    for option, component in declared_options():
        if component in set(COMPONENT_VARIABLES.values()):
            assert COMPONENT_VARIABLES.get(option.name) == component, option.name
    declared = {option.name for option, _ in declared_options()}
    installed = {c for _, c in declared_options()}
    for name, component in COMPONENT_VARIABLES.items():
        if component in installed:
            assert name in declared, f"{component} no longer declares {name}"


def test_options_are_frozen_and_sources_named() -> None:
    o = RuntimeOptions.defaults()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.cache_dir = "/tmp"  # type: ignore[misc]
    with pytest.raises(KeyError, match="no field 'cachedir'"):
        o.source("cachedir")
    settings = dict((name, (value, source)) for name, value, source in o.settings())
    assert settings["ORTMODULE_FALLBACK_RETRY"] == ("0", "default")
    assert settings["ORTMODULE_FALLBACK_POLICY"][0] == format_value(DEFAULT_FALLBACK_POLICY)
    assert o == RuntimeOptions.resolve(environ={})


def test_format_value() -> None:
    assert format_value(FP.FALLBACK_UNSUPPORTED_DEVICE | FP.FALLBACK_UNSUPPORTED_DATA) == (
        "FALLBACK_UNSUPPORTED_DEVICE|FALLBACK_UNSUPPORTED_DATA"
    )
    assert (
        format_value(True),
        format_value(None),
        format_value(LogLevel.INFO),
        format_value(3),
    ) == (
        "1",
        "unset",
        "INFO",
        "3",
    )


# -- DebugOptions ---------------------------------------------------------------------------------


def test_debug_options_as_the_guide() -> None:
    d = DebugOptions()
    assert (d.log_level, d.save_onnx, d.onnx_prefix) == (LogLevel.WARNING, False, "")
    d = DebugOptions(save_onnx=True, log_level=LogLevel.VERBOSE, onnx_prefix="model_name")
    assert d.save_onnx and d.log_level is LogLevel.VERBOSE and d.onnx_prefix == "model_name"
    assert DebugOptions(log_level="info").log_level is LogLevel.INFO  # type: ignore[arg-type]
    assert [level.name for level in sorted(LogLevel)] == [
        "VERBOSE",
        "DEVINFO",
        "INFO",
        "WARNING",
        "ERROR",
        "FATAL",
    ]


def test_save_onnx_needs_a_prefix() -> None:
    with pytest.raises(InvalidOptionError, match=r"save_onnx=True\) needs onnx_prefix"):
        DebugOptions(save_onnx=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"log_level": "LOUD"},
            r"DebugOptions.log_level='LOUD' is not a log level; use one of VERBOSE, DEVINFO",
        ),
        ({"log_level": 9}, "DebugOptions.log_level=9"),
        ({"log_level": True}, "DebugOptions.log_level=True"),
        ({"save_onnx": "yes"}, "DebugOptions.save_onnx='yes' must be True or False"),
        ({"onnx_prefix": 3}, "DebugOptions.onnx_prefix=3 must be a string"),
        ({"save_onnx": True, "onnx_prefix": "out/m"}, "without a path separator"),
    ],
)
def test_debug_options_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        DebugOptions(**kwargs)


def test_modules_import_without_onnxruntime_or_torch() -> None:
    """options, log, debug_options and doctor import neither the engine nor torch at module level."""
    code = BARE_PACKAGES + textwrap.dedent(
        """
        import ortmodule.options, ortmodule.log, ortmodule.debug_options, ortmodule.doctor
        heavy = sorted(m for m in ("onnxruntime", "torch", "onnx") if m in sys.modules)
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
