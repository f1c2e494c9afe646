"""Child processes that run one case after another (the fuzzer's worker, the transformers
coverage sweep): how one is asked to stop.

>>> stop_child(None, None)
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

__all__ = ["stop_child"]


def stop_child(proc: BaseProcess | None, conn: Connection | None) -> None:
    """Ask ``proc`` to finish (``None`` on its pipe ``conn``), wait 10 s, then kill it."""
    if proc is None or not proc.is_alive() or conn is None:
        return
    try:
        conn.send(None)
    except (BrokenPipeError, OSError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
