"""Memory statistics of the process at each phase of a training step.

``ORTMODULE_PRINT_MEMORY_STATS=1`` logs one line per phase (pre-forward, post-forward,
pre-backward, post-backward) of every step. On CUDA the numbers come from ``torch.cuda``'s
caching allocator (which the engine shares); on CPU from the process: resident set size now
and its high-water mark (``/proc/self/status``), in MiB.

>>> sample = memory_sample(torch.device("cpu"))
>>> sample["rss"] > 0 and sample["peak rss"] >= sample["rss"]
True
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["format_sample", "memory_sample", "peak_rss_bytes", "rss_bytes"]

_MIB = 2**20


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """The process's resident set size now (0 where the platform does not say)."""
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """The process's resident set size high-water mark."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes


def memory_sample(device: torch.device) -> dict[str, int]:
    """Named memory figures in MiB for ``device`` (CUDA: allocator statistics; CPU: process)."""
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        keys = {
            "allocated": "allocated_bytes.all.current",
            "max allocated": "allocated_bytes.all.peak",
            "cached": "reserved_bytes.all.current",
            "max cached": "reserved_bytes.all.peak",
            "inactive": "inactive_split_bytes.all.current",
            "max inactive": "inactive_split_bytes.all.peak",
        }
        return {name: int(stats.get(key, 0)) // _MIB for name, key in keys.items()}
    return {"rss": rss_bytes() // _MIB, "peak rss": peak_rss_bytes() // _MIB}


def format_sample(step: int, phase: str, sample: dict[str, int], rank: int, world: int) -> str:
    """``[0/1] step 3 memory (MiB) | phase: post_forward | rss: 412 | peak rss: 430``."""
    cells = " | ".join(f"{name}: {value}" for name, value in sample.items())
    return f"[{rank}/{world}] step {step} memory (MiB) | phase: {phase} | {cells}"
