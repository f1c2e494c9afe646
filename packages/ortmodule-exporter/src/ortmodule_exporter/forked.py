"""Run a piece of engine work in a forked child, so an engine crash cannot kill the process.

The engine (1.19.2, frozen) has graph rewrites that end in a segmentation fault or an abort
instead of an error (issue #42: ``DivMulFusion`` in the gradient build). The parent gets the
child's result (pickled through a pipe), its exception as a ``RuntimeError`` with the same
message, or :class:`EngineCrashed` naming the signal. Where ``fork`` is not available (not
Linux) or the child does not finish in time, the work runs in this process.

>>> run_forked(lambda: 1 + 1, timeout_s=60.0)
2
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["EngineCrashed", "run_forked"]

logger = logging.getLogger("ortmodule.engine")

T = TypeVar("T")


class EngineCrashed(Exception):
    """The child running the engine work died (``signal`` is its signal number, or None
    when it exited without an answer)."""

    def __init__(self, sig: int | None, code: int | None) -> None:
        self.signal = sig
        self.code = code
        if sig is not None:
            try:
                what = signal.Signals(sig).name
            except ValueError:
                what = f"signal {sig}"
        else:
            what = f"exit status {code}"
        super().__init__(f"the engine crashed ({what})")


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _child(fn: Callable[[], T], out: int) -> None:
    # the parent reports a crash; a faulthandler dump from the child would read as this
    # process dying
    faulthandler.disable()
    try:
        try:
            payload = pickle.dumps(("ok", fn()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as err:  # noqa: BLE001 -- every failure goes to the parent
            payload = pickle.dumps(("error", str(err)))
        view = memoryview(payload)
        while view:
            view = view[os.write(out, view) :]
    finally:
        os._exit(0)  # no atexit handlers, no flushing of the parent's buffers


def run_forked(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()``, computed in a forked child; see the module docstring."""
    if not _can_fork():
        return fn()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(fn, write)
    os.close(write)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([read], [], [], left)
            if not ready:
                continue
            chunk = os.read(read, 1 << 20)
            if not chunk:
                finished = True
                break
            chunks.append(chunk)
    finally:
        os.close(read)
    if not finished:
        # a child that hangs (a lock some other thread held at fork) gives no answer: the
        # work is done here instead
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        logger.info(
            "the engine's build in a child process took over %.0f s; building here", timeout_s
        )
        return fn()
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if os.WIFSIGNALED(status) or not data:
        raise EngineCrashed(
            os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        )
    kind, value = pickle.loads(data)
    if kind == "error":
        raise RuntimeError(value)
    return value  # type: ignore[no-any-return]
