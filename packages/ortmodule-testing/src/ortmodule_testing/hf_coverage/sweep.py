"""Run model types one at a time in a child process, so that a crash or a hang is recorded with
its model type instead of ending the sweep.

    with Sweeper(timeout=300) as sweeper:
        result = sweeper.run("llama", "causal-lm")   # a Result, "engine-crash" if it died

The child imports torch, transformers and ortmodule once and runs up to ``per_process`` model
types before it is replaced (importing transformers and ortmodule takes 10-25 s on a busy
2-core machine, longer than most tiny models take to train; ``per_process=1`` gives each model
type a fresh process). A model type that hangs past ``timeout`` seconds, or kills the process,
is recorded under the phase it was in: ``engine-crash`` in the engine phase, ``eager-error`` or
``not-built`` before it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from types import TracebackType

from ..child_process import stop_child
from .run_one import Result, run_model_type
from .tasks import TASKS_BY_NAME

__all__ = ["Sweeper"]

STARTUP_TIMEOUT = 600
_PHASE_STATUS = {
    "build": "not-built",
    "eager": "eager-error",
    "engine": "engine-crash",
    "float64": "engine-crash",  # the float64 reference runs only after the engine trained
}


def _serve(conn: Connection, log_path: str | None) -> None:
    if log_path:
        # the engine's and the libraries' chatter goes to the log, not over the sweep's output
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401

    import ortmodule  # noqa: F401 - imported before the clock of the first model starts

    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        model_type, task = job
        print(f"=== {model_type} ({task})", flush=True)
        result = run_model_type(
            model_type, TASKS_BY_NAME[task], on_phase=lambda phase: conn.send(("phase", phase))
        )
        conn.send(("result", result))


class Sweeper:
    """The child process and its timeout (see the module docstring)."""

    def __init__(
        self, timeout: float = 300.0, per_process: int = 20, log_path: str | None = None
    ) -> None:
        self.timeout = timeout
        self.per_process = per_process
        self.log_path = log_path
        self._ctx = mp.get_context("spawn")
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._runs = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.log_path), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._runs = 0
        if not (parent.poll(STARTUP_TIMEOUT) and parent.recv() == "ready"):
            self.close()
            raise RuntimeError(
                "the sweep's worker process did not start: torch, transformers and ortmodule "
                f"must import in a fresh process (see {self.log_path or 'its error above'})"
            )

    def run(self, model_type: str, task: str) -> Result:
        """``model_type`` under ``task`` (a name from :data:`~.tasks.TASKS`), in the child."""
        if self._proc is None or not self._proc.is_alive() or self._runs >= self.per_process:
            self.close()
            self._start()
        assert self._conn is not None and self._proc is not None
        self._runs += 1
        start = time.monotonic()
        self._conn.send((model_type, task))
        phase = "build"
        while True:
            left = self.timeout - (time.monotonic() - start)
            try:
                ready = left > 0 and self._conn.poll(left)
                message = self._conn.recv() if ready else None
            except (EOFError, OSError):  # the child died
                message, ready = None, True
            if message is None:
                break
            kind, value = message
            if kind == "result":
                return value  # type: ignore[no-any-return]
            phase = value
        if ready:
            self._proc.join(5)
            why = f"the process died in the {phase} phase (exit code {self._proc.exitcode})"
        else:
            self._proc.kill()
            self._proc.join()
            why = f"no result after {self.timeout:.0f} s in the {phase} phase (killed)"
        self._proc = None
        task_obj = TASKS_BY_NAME[task]
        class_name = task_obj.class_names().get(model_type, "?")
        class_name = class_name if isinstance(class_name, str) else class_name[0]
        seconds = round(time.monotonic() - start, 1)
        return Result(model_type, task, class_name, _PHASE_STATUS[phase], why, "", seconds)

    def close(self) -> None:
        stop_child(self._proc, self._conn)
        self._proc = None

    def __enter__(self) -> Sweeper:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
