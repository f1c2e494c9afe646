"""Run OpInfo ops in worker processes: ``opinfo_sweep.py --serve`` reads an op name a line
and answers a JSON line; an op that kills its worker fails alone and the sweep goes on in a
fresh one. ``test_opinfo.py`` and the frontends' side-by-side table
(:mod:`ortmodule_testing.frontends.measure`) both sweep through here.

>>> results, known = sweep(Path("packages/ortmodule/tests/opinfo_sweep.py"), ["abs"], workers=1)
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["OP_TIMEOUT_S", "OpWorker", "sweep"]

#: an op taking longer than this is stopped and reported
OP_TIMEOUT_S = 120.0


class OpWorker:
    """One ``<script> --serve`` process; :meth:`run` reports a timeout or the process's death
    as a failure of that op. ``ops`` is the op list the worker announced when ready."""

    def __init__(
        self,
        script: Path,
        env: Mapping[str, str] | None = None,
        op_timeout_s: float = OP_TIMEOUT_S,
        start_timeout_s: float = 600.0,
    ) -> None:
        base = dict(os.environ if env is None else env)
        self.op_timeout_s = op_timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, str(script.resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**base, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"},
            cwd=script.resolve().parent,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.lines.get(timeout=start_timeout_s)
        if ready is None:
            raise RuntimeError(f"the OpInfo worker {script} did not start")
        self.ops: list[str] = list(json.loads(ready)["ready"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, op: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=self.op_timeout_s)
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            return {"status": "fail", "error": f"timed out after {self.op_timeout_s:.0f} s"}
        if line is None:
            code = self.proc.wait()
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return {"status": "fail", "error": f"the process died ({how})", "died": True}
        return dict(json.loads(line))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def sweep(
    script: Path,
    ops: list[str],
    workers: int,
    env: Mapping[str, str] | None = None,
    op_timeout_s: float = OP_TIMEOUT_S,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Run ``ops`` over ``workers`` processes of ``script``: each op's result, and the op list
    the workers know."""
    todo: queue.Queue[str] = queue.Queue()
    for op in ops:
        todo.put(op)
    results: dict[str, dict[str, Any]] = {}
    known: list[str] = []

    def loop() -> None:
        worker = OpWorker(script, env, op_timeout_s)
        known[:] = worker.ops
        while True:
            try:
                op = todo.get_nowait()
            except queue.Empty:
                break
            if not worker.alive():
                worker = OpWorker(script, env, op_timeout_s)
            results[op] = worker.run(op)
        worker.close()

    threads = [threading.Thread(target=loop) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, known
