"""Each log level's observable behaviour: engine severity, logger, ranks, held-back output, fds."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import BARE_PACKAGES

from ortmodule import log
from ortmodule.debug_options import LogLevel
from ortmodule.log import (
    PhaseTimer,
    add_recommendation,
    clear_recommendations,
    configure_logger,
    current_rank,
    engine_severity,
    exporter_log_filtering,
    exporter_verbose,
    logger_level,
    rank_zero_only,
    recommendations,
    suppress_output,
)

L = LogLevel
HELD_BACK = (L.FATAL, L.ERROR, L.WARNING)
SHOWN = (L.DEVINFO, L.VERBOSE)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- the table, as the guide states it -----------------------------------------------------------


def test_engine_severity_per_level() -> None:
    # engine scale: 0 VERBOSE, 1 INFO, 2 WARNING, 3 ERROR, 4 FATAL
    assert {level: engine_severity(level) for level in L} == {
        L.FATAL: 4,
        L.ERROR: 3,
        L.WARNING: 2,
        L.INFO: 2,  # INFO keeps the engine at WARNING
        L.DEVINFO: 1,
        L.VERBOSE: 0,
    }


def test_logger_level_per_level() -> None:
    assert {level: logger_level(level) for level in L} == {
        L.FATAL: logging.CRITICAL,
        L.ERROR: logging.ERROR,
        L.WARNING: logging.WARNING,
        L.INFO: logging.INFO,
        L.DEVINFO: logging.INFO,
        L.VERBOSE: logging.DEBUG,
    }


def test_rank_filter_export_filter_and_verbose_trace_per_level() -> None:
    assert [level for level in L if rank_zero_only(level)] == [L.INFO, L.WARNING, L.ERROR, L.FATAL]
    assert [level for level in L if exporter_log_filtering(level)] == [
        L.INFO,
        L.WARNING,
        L.ERROR,
        L.FATAL,
    ]
    assert [level for level in L if exporter_verbose(level, rank=0)] == [
        L.VERBOSE,
        L.DEVINFO,
        L.INFO,
    ]
    assert [level for level in L if exporter_verbose(level, rank=1)] == [L.VERBOSE, L.DEVINFO]


def test_current_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert current_rank() == 0
    monkeypatch.setenv("RANK", "3")
    assert current_rank() == 3
    monkeypatch.setenv("RANK", "not-a-number")
    assert current_rank() == 0


# -- the logger ----------------------------------------------------------------------------------


def test_configure_logger_is_idempotent_and_rank_filtered() -> None:
    logger = configure_logger(L.INFO, rank=0)
    configure_logger(L.INFO, rank=0)
    try:
        assert logger.name == "ortmodule"
        assert sum(isinstance(h, log._ConsoleHandler) for h in logger.handlers) == 1
        assert logger.level == logging.INFO
        assert logging.getLogger("ortmodule.exporter").getEffectiveLevel() == logging.INFO
        assert not configure_logger(L.INFO, rank=1).isEnabledFor(logging.CRITICAL)  # rank 0 only
        assert not configure_logger(L.WARNING, rank=2).isEnabledFor(logging.ERROR)
        assert configure_logger(L.DEVINFO, rank=1).isEnabledFor(logging.INFO)  # every rank
        assert configure_logger(L.VERBOSE, rank=1).isEnabledFor(logging.DEBUG)
        assert configure_logger(L.ERROR, rank=0).getEffectiveLevel() == logging.ERROR
        assert sum(isinstance(h, log._ConsoleHandler) for h in logger.handlers) == 1
    finally:
        configure_logger(L.WARNING, rank=0)


def test_records_reach_application_handlers(caplog: pytest.LogCaptureFixture) -> None:
    configure_logger(L.INFO, rank=0)
    try:
        logging.getLogger("ortmodule.exporter").info("exported in %d s", 3)
        logging.getLogger("ortmodule").debug("not at INFO")
    finally:
        configure_logger(L.WARNING, rank=0)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("ortmodule")] == [
        "exported in 3 s"
    ]


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the modules under test importable and return its captured output."""
    prelude = BARE_PACKAGES + textwrap.dedent(
        """
        import os, logging, ctypes
        from ortmodule.log import LogLevel, suppress_output, configure_logger
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_console_handler_prints_without_logging_setup_and_through_suppression() -> None:
    done = _run(
        """
        logger = configure_logger(LogLevel.WARNING)
        configure_logger(LogLevel.WARNING)
        logger.warning("from ortmodule")
        with suppress_output(LogLevel.WARNING):
            logging.getLogger("ortmodule.exporter").warning("inside a suppressed region")
            os.write(2, b"engine noise")
        logger.info("not at WARNING")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "[ORTModule WARNING] from ortmodule",
        "[ORTModule WARNING] inside a suppressed region",
    ]


def test_rank_filtering_in_a_process(tmp_path: Path) -> None:
    code = """
        for level in (LogLevel.INFO, LogLevel.DEVINFO):
            configure_logger(level).info("at %s", level.name)
        """
    assert _run(code, {"RANK": "0"}).stderr.splitlines() == [
        "[ORTModule INFO] at INFO",
        "[ORTModule rank 0 INFO] at DEVINFO",
    ]
    assert _run(code, {"RANK": "1"}).stderr.splitlines() == ["[ORTModule rank 1 INFO] at DEVINFO"]


# -- suppressed regions --------------------------------------------------------------------------


def _noisy() -> None:
    os.write(1, b"c-level stdout\n")
    os.write(2, b"c-level stderr\n")
    os.write(2, b"[W] The shape inference of com.microsoft::PythonOp type is missing\n")
    print("python stdout")
    print("python stderr", file=sys.stderr)


@pytest.mark.parametrize("level", HELD_BACK)
def test_warning_and_above_hold_native_output_back_and_keep_python_output(
    level: LogLevel, capfd: pytest.CaptureFixture[str]
) -> None:
    before = _open_fds()
    with suppress_output(level):
        _noisy()
    assert _open_fds() == before
    # the native lines (the engine's and exporter's logging) are dropped; print() is the user's
    assert capfd.readouterr() == ("python stdout\n", "python stderr\n")


def test_other_threads_keep_their_output(capfd: pytest.CaptureFixture[str]) -> None:
    import threading

    started, finish = threading.Event(), threading.Event()

    def user_thread() -> None:
        started.set()
        finish.wait(10)
        print("from the user's thread", flush=True)

    thread = threading.Thread(target=user_thread)
    thread.start()
    started.wait(10)
    with suppress_output(L.WARNING):
        os.write(2, b"engine noise\n")
        finish.set()
        thread.join(10)
    out, err = capfd.readouterr()
    assert out == "from the user's thread\n" and err == ""


@pytest.mark.parametrize("level", SHOWN)
def test_devinfo_and_verbose_redirect_nothing(
    level: LogLevel, capfd: pytest.CaptureFixture[str]
) -> None:
    before = _open_fds()
    with suppress_output(level):
        assert _open_fds() == before  # no temporary file, no saved descriptors: pdb works
        _noisy()
    out, err = capfd.readouterr()
    assert out == "c-level stdout\npython stdout\n"
    assert (
        err
        == "c-level stderr\n[W] The shape inference of com.microsoft::PythonOp type is missing\npython stderr\n"
    )


def test_info_shows_output_without_noise_on_rank_0(capfd: pytest.CaptureFixture[str]) -> None:
    before = _open_fds()
    with suppress_output(L.INFO, rank=0):
        _noisy()
        # native output held back while the region runs
        assert capfd.readouterr() == ("python stdout\n", "python stderr\n")
    assert _open_fds() == before
    out, err = capfd.readouterr()
    assert out == "c-level stdout\n"
    assert err == "c-level stderr\n"  # the shape-inference noise is dropped

    with suppress_output(L.INFO, rank=1):
        _noisy()
    assert capfd.readouterr() == ("python stdout\n", "python stderr\n")


@pytest.mark.parametrize("level", [L.WARNING, L.INFO])
def test_error_in_a_suppressed_region_keeps_its_full_message(
    level: LogLevel, capfd: pytest.CaptureFixture[str]
) -> None:
    before = _open_fds()
    with pytest.raises(RuntimeError, match="graph build failed") as info:
        with suppress_output(level):
            os.write(2, b"[E:onnxruntime] Node (Gemm_3) failed: shape mismatch [4,3] vs [5,3]\n")
            raise RuntimeError("graph build failed")
    assert _open_fds() == before
    out, err = capfd.readouterr()
    assert "Node (Gemm_3) failed: shape mismatch" in err
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "Node (Gemm_3) failed: shape mismatch" in notes
        assert f"held back at log level {level.name}" in notes


def test_fds_restored_after_many_regions_and_failures() -> None:
    before = _open_fds()
    for i in range(20):
        try:
            with suppress_output(L.WARNING):
                os.write(1, b"x")
                if i % 2:
                    raise ValueError(i)
        except ValueError:
            pass
    assert _open_fds() == before


def test_nested_regions_hold_back_once(capfd: pytest.CaptureFixture[str]) -> None:
    with suppress_output(L.WARNING):
        with suppress_output(L.INFO):
            os.write(1, b"inner\n")
        os.write(1, b"outer\n")
    assert capfd.readouterr() == ("", "")
    with pytest.raises(KeyError):
        with suppress_output(L.WARNING):
            with suppress_output(L.WARNING):
                os.write(2, b"said once\n")
                raise KeyError("x")
    assert capfd.readouterr().err.count("said once") == 1


def test_c_library_output_is_held_back_even_when_buffered() -> None:
    # stdout is a pipe here, so libc buffers puts(): the region must flush it before restoring
    done = _run(
        """
        libc = ctypes.CDLL(None)
        with suppress_output(LogLevel.WARNING):
            libc.puts(b"from C at WARNING")
        with suppress_output(LogLevel.DEVINFO):
            libc.puts(b"from C at DEVINFO")
        libc.fflush(None)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "from C at DEVINFO\n"


def _exporter_warning() -> None:
    warnings.warn_explicit(
        "ONNX export warning", UserWarning, "utils.py", 1, module="torch.onnx.utils"
    )


def test_torch_onnx_warnings_silenced_in_suppressed_regions() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with suppress_output(L.WARNING):
            _exporter_warning()
            warnings.warn("ORTModule's own warning", UserWarning, stacklevel=1)
        with suppress_output(L.DEVINFO):
            _exporter_warning()
        _exporter_warning()
    assert [str(w.message) for w in caught] == [
        "ORTModule's own warning",
        "ONNX export warning",
        "ONNX export warning",
    ]


# -- INFO summaries ------------------------------------------------------------------------------


def test_phase_timer_summary() -> None:
    timer = PhaseTimer()
    timer.add("session creation", 0.5)
    with timer.phase("export"):
        pass
    timer.add("graph build", 1.25)
    timer.add("graph build", 0.25)
    summary = timer.summary()
    assert summary.startswith("ORTModule initialisation took ")
    assert (
        summary.index("export")
        < summary.index("graph build 1.50 s")
        < summary.index("session creation 0.50 s")
    )
    assert timer.seconds["graph build"] == pytest.approx(1.5)
    assert timer.total >= 2.0
    assert PhaseTimer().summary() == "ORTModule initialisation took 0.00 s: nothing timed"


def test_recommendations_registry(caplog: pytest.LogCaptureFixture) -> None:
    clear_recommendations()
    try:
        add_recommendation("Set ORTMODULE_MEMORY_OPT_LEVEL=1 to recompute 12 layers.")
        add_recommendation("Set ORTMODULE_MEMORY_OPT_LEVEL=1 to recompute 12 layers.")
        add_recommendation("Use a padding-free batch sampler.")
        assert recommendations() == (
            "Set ORTMODULE_MEMORY_OPT_LEVEL=1 to recompute 12 layers.",
            "Use a padding-free batch sampler.",
        )
        timer = PhaseTimer()
        timer.add("export", 1.0)
        with caplog.at_level(logging.INFO, logger="ortmodule"):
            log.log_initialisation_summary(timer)
        assert [r.getMessage() for r in caplog.records] == [
            timer.summary(),
            "Recommendation: Set ORTMODULE_MEMORY_OPT_LEVEL=1 to recompute 12 layers.",
            "Recommendation: Use a padding-free batch sampler.",
        ]
    finally:
        clear_recommendations()


def test_a_print_in_forward_reaches_the_user_at_warning(
    capfd: pytest.CaptureFixture[str],
) -> None:
    import torch

    from ortmodule import ORTModule

    class Talks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            print("user forward ran")
            return self.fc(x)

    model = ORTModule(Talks())  # WARNING: the export's native output is held back
    model(torch.randn(3, 4)).sum().backward()
    assert "user forward ran" in capfd.readouterr().out


def test_recompute_at_warning_prints_nothing_of_the_engine(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The opportunity table is read from the engine after the session exists; its analysis
    logs engine warnings (a layer-boundary notice) that WARNING holds back like the build's."""
    pytest.importorskip("ortmodule_memory")
    from ortmodule import DebugOptions, ORTModule
    from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

    torch.manual_seed(0)
    model = ORTModule(
        GPTDecoder(GPTConfig.small()), DebugOptions(memory_opt_level=1, log_level=L.WARNING)
    )
    ids = torch.randint(0, 128, (2, 16))
    capfd.readouterr()
    loss, _ = model(ids, labels=ids)
    loss.backward()
    out, err = capfd.readouterr()
    assert "onnxruntime" not in out + err, out + err
