"""``forked.run_forked``: engine work in a child process, a crash there an exception here."""

from __future__ import annotations

import ctypes
import signal
import sys

import pytest

from ortmodule_exporter.forked import EngineCrashed, run_forked

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork: Linux only")


def test_the_result_comes_back() -> None:
    assert run_forked(lambda: {"a": [1, 2], "b": b"x" * (1 << 22)}, 60.0) == {
        "a": [1, 2],
        "b": b"x" * (1 << 22),
    }


def test_an_exception_comes_back_with_its_message() -> None:
    def fail() -> None:
        raise ValueError("no such node")

    with pytest.raises(RuntimeError, match="no such node"):
        run_forked(fail, 60.0)


def test_a_segfault_is_an_exception() -> None:
    with pytest.raises(EngineCrashed, match="SIGSEGV") as info:
        run_forked(lambda: ctypes.string_at(0), 60.0)
    assert info.value.signal == signal.SIGSEGV


def test_an_abort_is_an_exception() -> None:
    import os

    with pytest.raises(EngineCrashed, match="SIGABRT"):
        run_forked(os.abort, 60.0)


def test_a_child_that_hangs_is_abandoned_and_the_work_done_here() -> None:
    import os
    import time

    parent = os.getpid()

    def slow_in_child() -> int:
        if os.getpid() != parent:
            time.sleep(60)
        return os.getpid()

    assert run_forked(slow_in_child, 1.0) == parent
