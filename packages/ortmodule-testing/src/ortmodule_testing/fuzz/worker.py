"""Programs run in a child process, so that a crash (segfault, abort) or a hang is recorded with
its program instead of ending the fuzzer.

    with Worker(timeout=120) as worker:
        outcome = worker.run(program)  # Outcome("crashed", ...) when the child died
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType

from ..child_process import stop_child
from .program import Program
from .runner import Engine, Outcome, Refusals, run_program

__all__ = ["Worker"]

# A child that has run this many programs is replaced: engine sessions and caches of finished
# programs must not pile up over thousands of programs.
RECYCLE_AFTER = 200
STARTUP_TIMEOUT = 600


def _recv_or_none(conn: Connection) -> object:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


EngineFactory = Callable[[], tuple[Engine, Refusals]]


def ortmodule() -> tuple[Engine, Refusals]:
    """ORTModule and its refusals; imported in the child only, the parent stays light."""
    from .engine import REFUSALS, ortmodule_engine

    return ortmodule_engine, REFUSALS


def _serve(conn: Connection, factory: EngineFactory) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    engine, refusals = factory()
    conn.send("ready")
    while True:
        program = conn.recv()
        if program is None:
            return
        conn.send(run_program(program, engine, refusals))


class Worker:
    """One child process (spawned: no state forked from the parent) running programs in turn.

    ``factory`` (a module-level function, so the child can import it) gives the engine wrapper
    and its refusals in the child; by default ORTModule.
    """

    def __init__(self, timeout: float = 120.0, factory: EngineFactory | None = None) -> None:
        self.timeout = timeout
        self.factory = factory or ortmodule
        self._ctx = mp.get_context("spawn")
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._runs = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.factory), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._runs = 0
        # The per-program timeout starts once the child has imported torch and the engine.
        ready = parent.poll(STARTUP_TIMEOUT) and _recv_or_none(parent) == "ready"
        if not ready:
            self._proc.join(5)
            code = self._proc.exitcode
            self.close()
            how = (
                f"exited with code {code}"
                if code is not None
                else f"was not ready in {STARTUP_TIMEOUT} s"
            )
            raise RuntimeError(
                f"the fuzz worker process {how} (its error is above); torch and ortmodule must "
                "import in a fresh process, and a script that starts workers needs an "
                "`if __name__ == '__main__':` guard (multiprocessing's spawn re-imports it)"
            )

    def run(self, program: Program) -> Outcome:
        if self._proc is None or not self._proc.is_alive() or self._runs >= RECYCLE_AFTER:
            self.close()
            self._start()
        assert self._conn is not None and self._proc is not None
        self._runs += 1
        self._conn.send(program)
        if self._conn.poll(self.timeout):
            try:
                outcome: Outcome = self._conn.recv()
                return outcome
            except (EOFError, OSError):  # the child died while answering
                pass
        else:
            self._proc.kill()
            self._proc.join()
            self._proc = None
            return Outcome("crashed", f"no result after {self.timeout:.0f} s (killed)")
        self._proc.join(5)
        code = self._proc.exitcode
        self._proc = None
        return Outcome("crashed", f"the process died (exit code {code})")

    def close(self) -> None:
        stop_child(self._proc, self._conn)
        self._proc = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
