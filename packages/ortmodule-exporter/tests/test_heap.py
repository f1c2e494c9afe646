"""The C heap's free pages go back after the backward of a CPU session without an arena."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ortmodule_exporter import engine, heap

#: a fresh process: 1 MiB blocks come from glibc's heap (its mmap threshold pinned above them,
#: as glibc's own raises it after large frees), 96 of them are touched and freed below a block
#: that stays, so the heap cannot shrink from its top; prints the resident MiB freed-but-kept
#: and after ``release_free_pages``
_FREED_HEAP = """
import ctypes, ctypes.util
from ortmodule_exporter.heap import release_free_pages

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert libc.mallopt(-3, 64 << 20) == 1  # M_MMAP_THRESHOLD

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 2**20

blocks = [libc.malloc(1 << 20) for _ in range(96)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
top = libc.malloc(1 << 20)
ctypes.memset(top, 1, 1 << 20)
for b in blocks:
    libc.free(b)
kept = resident_mib()
print("released", release_free_pages(), kept, resident_mib())
"""


def test_free_heap_pages_go_back_to_the_system() -> None:
    if not sys.platform.startswith("linux") or heap._trim() is None:
        pytest.skip("needs glibc's malloc_trim")
    out = subprocess.run(
        [sys.executable, "-c", _FREED_HEAP], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    released, kept, after = out.stdout.split("released")[-1].split()
    assert released == "True"
    # the 96 freed MiB were resident until the trim
    assert int(kept) - int(after) > 64, (kept, after)


class _Agent:
    def run_backward(self, *args: object) -> None:
        pass


def test_only_cpu_sessions_without_the_arena_release() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert engine._releases_heap_after_backward(engine.SessionConfig(cpu, cpu_arena=False))
    assert not engine._releases_heap_after_backward(engine.SessionConfig(cpu))
    assert not engine._releases_heap_after_backward(engine.SessionConfig(cuda, cpu_arena=False))


@pytest.mark.parametrize("release", [True, False])
def test_the_backward_releases_where_the_session_says(
    monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(engine, "release_free_pages", lambda: calls.append(1) or True)
    session = object.__new__(engine.TrainingSession)  # the engine's agent replaced below
    session._agent = _Agent()
    session._threads, session._trial = engine.TorchThreadsInEngine(0), None
    session._release_after_backward = release
    state = engine.ForwardState(None, engine.python_op_runner.RunContexts())
    assert session.backward([], state) == []
    assert calls == ([1] if release else [])
