"""``ORTMODULE_ENABLE_TUNING``: pick each kernel's block size and warps by timing them.

With tuning on, the first launch of a kernel at a new shape times a set of candidate launch
configs, within ``ORTMODULE_MAX_TUNING_DURATION_MS`` per kernel and shape (default 1000 ms), and
keeps the fastest; results are saved to ``ORTMODULE_TUNING_RESULTS_PATH`` (JSON) when it is set.
With tuning off and a results path set, the saved choices are loaded and used ("offline tuning").
Keys are the kernel's name (a hash of its source) and the shape and dtypes of its inputs.

On CPU the interpreter's timings say nothing about a GPU: the mechanism runs there for tests.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .codegen import KernelPlan
from .kernel import LaunchConfig, set_launch_chooser

__all__ = ["DEFAULT_DURATION_MS", "Tuner", "configure_tuning"]

logger = logging.getLogger("ortmodule.triton")
DEFAULT_DURATION_MS = 1000
_VERSION = 1


def _candidates(plan: KernelPlan, default: LaunchConfig) -> list[LaunchConfig]:
    if plan.reduce_start is None:
        return [LaunchConfig(b, w) for b in (256, 512, 1024, 2048) for w in (2, 4, 8)]
    block = default.block
    rows = sorted({1, default.rows, max(1, default.rows // 4)})
    return [
        LaunchConfig(block, w, r)
        for r in rows
        for w in (1, 2, 4, 8, 16)
        if w * 32 <= max(block * r, 32)
    ]


class Tuner:
    """Chooses launch configs; see the module docstring."""

    def __init__(self, enabled: bool, max_ms: int | None, results_path: Path | None) -> None:
        self.enabled = enabled
        self.max_ms = max_ms or DEFAULT_DURATION_MS
        self.path = results_path
        self.results: dict[str, dict[str, list[int]]] = {}
        self.tuned = 0
        self._lock = threading.Lock()
        if results_path is not None and results_path.is_file():
            self.results = self._read(results_path)

    @staticmethod
    def _read(path: Path) -> dict[str, dict[str, list[int]]]:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(
                f"ORTMODULE_TUNING_RESULTS_PATH={str(path)!r}: not a tuning results file ({err}); "
                "delete it or point the variable elsewhere"
            ) from None
        if not isinstance(raw, dict) or raw.get("version") != _VERSION:
            raise ValueError(
                f"ORTMODULE_TUNING_RESULTS_PATH={str(path)!r}: not a version-{_VERSION} "
                "ortmodule-triton tuning results file"
            )
        kernels: dict[str, dict[str, list[int]]] = raw.get("kernels", {})
        return kernels

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(self.path.suffix + f".{os.getpid()}.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": _VERSION, "kernels": self.results}, indent=1))
        tmp.replace(self.path)

    def choose(
        self,
        plan: KernelPlan,
        key: str,
        default: LaunchConfig,
        run: Callable[[LaunchConfig], None],
    ) -> LaunchConfig:
        with self._lock:
            known = self.results.get(plan.key, {}).get(key)
        if known is not None:
            return LaunchConfig(*(int(v) for v in known))
        if not self.enabled:
            return default
        budget = self.max_ms / 1000.0
        start = time.perf_counter()
        best, best_time = default, float("inf")
        for config in _candidates(plan, default):
            if time.perf_counter() - start > budget:
                break
            try:
                elapsed = _time(run, config)
            except Exception as err:  # noqa: BLE001 - a config the device cannot launch
                logger.debug("tuning %s: %s failed: %s", plan.fn_name, config, err)
                continue
            if elapsed < best_time:
                best, best_time = config, elapsed
        with self._lock:
            self.results.setdefault(plan.key, {})[key] = [best.block, best.num_warps, best.rows]
            self.tuned += 1
            self._save()
        logger.info(
            "tuned %s at %s: block %d, %d warps", plan.fn_name, key, best.block, best.num_warps
        )
        return best


def _time(run: Callable[[LaunchConfig], None], config: LaunchConfig) -> float:
    cuda = torch.cuda.is_available()
    run(config)  # compile and warm up
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        run(config)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / 3


def configure_tuning(enabled: bool, max_ms: int | None, results_path: Path | None) -> Tuner | None:
    """Install a tuner for every kernel launch (``None`` when there is nothing to do)."""
    if not enabled and results_path is None:
        set_launch_chooser(None)
        return None
    tuner = Tuner(enabled, max_ms, results_path)
    set_launch_chooser(tuner.choose)
    return tuner
