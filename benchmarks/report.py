"""The benchmark report: machine description, tables, notes, the exact commands, as Markdown."""

from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from .models import DEFAULT_MODELS, SCALE_MODELS, TINY, WORKLOADS
from .stats import goal_verdict

#: ORTModule's step time as a multiple of eager's that the project aims at, per default model
#: (interleaved ratio, at or below); the rest of the default models: 1.0
SPEED_GOALS = {"gpt": 0.85, "masked_lm": 0.6}
#: ORTModule under bfloat16 autocast against eager under the same autocast (interleaved, at or
#: below); the rest of the autocast models: 1.0
AUTOCAST_GOALS = {"gpt": 0.85}
#: the rows of ``--scale`` (report keys), in table order: ``ortmodule-level1``/``-level2`` are
#: ORTModule under ``ORTMODULE_MEMORY_OPT_LEVEL``, ``ortmodule-level1-auto`` level 1 with
#: ``ORTMODULE_KERNEL_CHOICE=AUTO`` (the products on PyTorch's kernels where faster, kept, not
#: recomputed), ``ortmodule-warm`` a second process on the export cache the cold one filled
SCALE_MODES = (
    "eager",
    "eager-checkpoint",
    "compile",
    "ortmodule",
    "ortmodule-warm",
    "ortmodule-level1",
    "ortmodule-level1-auto",
    "ortmodule-level2",
)

#: /proc/cpuinfo flags that decide how fast bfloat16 is on a CPU: native bf16 dot products
#: (AVX512-BF16, AMX), the AVX-512 they build on, and what PyTorch falls back to without them
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx512f", "avx2", "fma")
#: any of these: PyTorch's CPU kernels compute bfloat16 natively (oneDNN); otherwise every
#: bfloat16 operator converts to float32 and back
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")

MODE_TITLES = {
    "eager": "PyTorch eager",
    "compile": "torch.compile (inductor)",
    "ortmodule": "ORTModule",
    "ortmodule-warm": "ORTModule, warm cache",
    "ortmodule-label-off": "ORTModule, label sparsity off",
    "ortmodule-padding": "ORTModule, padding elimination on",
    "eager-bf16": "PyTorch eager, bf16 autocast",
    "compile-bf16": "torch.compile, bf16 autocast",
    "ortmodule-bf16": "ORTModule, bf16 autocast",
    "ortmodule-level1": "ORTModule, ORTMODULE_MEMORY_OPT_LEVEL=1",
    "ortmodule-level1-auto": "ORTModule, ORTMODULE_MEMORY_OPT_LEVEL=1, ORTMODULE_KERNEL_CHOICE=AUTO",
    "ortmodule-level2": "ORTModule, ORTMODULE_MEMORY_OPT_LEVEL=2",
    "eager-checkpoint": "PyTorch eager, gradient_checkpointing_enable()",
}


def cpu_flags() -> list[str]:
    """Of :data:`BF16_FLAGS`, those this CPU has (from /proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in BF16_FLAGS if flag in have]
    except OSError:
        pass
    return []


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


#: modules a first step imports lazily (the model's code, the exporter, torch.onnx's): whether
#: their source is compiled again in each process shows in first-step times
_LAZY_MODULES = (
    "transformers.models.gpt2.modeling_gpt2",
    "torch.onnx._internal.torchscript_exporter.utils",
    "ortmodule_exporter.export.exporter",
)


def bytecode_cached() -> tuple[int, int]:
    """(how many of :data:`_LAZY_MODULES` have a current ``.pyc``, how many were found)."""
    import importlib.util

    cached = found = 0
    for name in _LAZY_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        found += 1
        pyc = importlib.util.cache_from_source(spec.origin)
        if os.path.exists(pyc) and os.path.getmtime(pyc) >= os.path.getmtime(spec.origin):
            cached += 1
    return cached, found


def machine_info() -> dict[str, Any]:
    import torch

    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    versions = {"python": platform.python_version()}
    for dist in ("torch", "onnxruntime-training-cpu", "onnxruntime-training", "onnx", "ortmodule"):
        found = _version(dist)
        if found:
            versions[dist] = found
    return {
        "cpu": _cpu_model(),
        "cores": cores,
        "usable_cores": usable,
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "versions": versions,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "bf16_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bytecode_cached": bytecode_cached(),
        "dont_write_bytecode": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
    }


def machine_slug(info: dict[str, Any]) -> str:
    """``amd-epyc-2c``: the CPU model and core count, for the results file name."""
    cpu = re.sub(r"\((r|tm)\)|cpu|processor|@.*$|\d+-core", "", info["cpu"].lower())
    words = re.findall(r"[a-z0-9]+", cpu)[:4]
    return "-".join([*words, f"{info['cores']}c"])


@dataclass
class Report:
    info: dict[str, Any]
    full: bool
    command: str
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float] | None = None
    runs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    overhead: dict[str, dict[str, Any]] = field(default_factory=dict)
    micro: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per model, the interleaved run (``worker ratio``): modes taking turns in one process
    interleaved: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per model, the interleaved run of fp32 eager and the bfloat16 autocast modes (--bf16)
    autocast: dict[str, dict[str, Any]] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: intra-op threads forced with --threads, or None for PyTorch's default
    threads: int | None = None
    #: ``--note``: a line of context for the reader (other work on the machine, ...)
    note: str | None = None

    # -- figures ---------------------------------------------------------------------------
    def loss_diff(self, model: str, mode: str) -> float | None:
        """Largest |loss - eager loss| over the measured steps (same init, same batches); for
        ORTModule and torch.compile under autocast, eager's under the same autocast."""
        base = "eager-bf16" if mode in ("ortmodule-bf16", "compile-bf16") else "eager"
        eager, run = self.runs.get((model, base)), self.runs.get((model, mode))
        if not eager or not run or "error" in eager or "error" in run:
            return None
        warmup = run["warmup"]
        a, b = eager["losses"][warmup:], run["losses"][warmup:]
        if not a or len(a) != len(b):
            return None
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    def ratio(self, model: str, mode: str) -> float | None:
        eager, run = self.runs.get((model, "eager"), {}), self.runs.get((model, mode), {})
        if "median_step_s" in eager and "median_step_s" in run:
            return float(run["median_step_s"] / eager["median_step_s"])
        return None

    def busy(self) -> bool:
        """Whether other work shared the CPU: load before we started, or well above our own after."""
        cores = self.info["cores"]
        after = self.load_after[0] if self.load_after else 0.0
        # once running, the suite's own process keeps the load near the thread count
        return self.load_before[0] > 0.75 * cores or after > 1.25 * cores

    # -- tables ----------------------------------------------------------------------------
    def interleaved_section(self) -> list[str]:
        """Ratios from one process per model whose modes take turns step by step."""
        if not self.interleaved:
            return []
        modes = [
            m
            for m in ("ortmodule", "compile")
            if any(m in r.get("ratio", {}) for r in self.interleaved.values())
        ]
        names = {"ortmodule": "ORTModule", "compile": "torch.compile"}
        lines = [
            "## Step time vs eager, interleaved",
            "",
            "One process per model holds eager, ORTModule and torch.compile copies of the model "
            "(same weights, same batches) and runs one training step of each in turn, rotating "
            "who goes first; the ratio is the median over the measured rounds of each step's time "
            "over eager's step in the same round. Load that comes and goes hits every mode of a "
            "round alike, so these are the ratios to compare on a busy machine. In brackets: "
            "the 95% interval of that median (distribution-free, `benchmarks/stats.py`; with "
            "fewer than 10 rounds it is the whole range of the rounds).",
            "",
            "| model | eager median step | "
            + " | ".join(f"{names[m]} vs eager" for m in modes)
            + " | max loss diff (ORTModule) |",
            "| --- | ---: | " + " | ".join("---:" for _ in modes) + " | ---: |",
        ]
        for model, run in self.interleaved.items():
            if "error" in run:
                lines.append(
                    f"| {model} | error: {_cell(run['error'])} |" + " |" * len(modes) + " |"
                )
                continue
            diff = run.get("max_loss_diff", {}).get("ortmodule")
            lines.append(
                f"| {model} | {_ms(run.get('median_step_s', {}).get('eager'))} | "
                + " | ".join(_ratio_cell(run, m) for m in modes)
                + f" | {'' if diff is None else f'{diff:.1e}'} |"
            )
        return [*lines, ""]

    def goals_section(self) -> list[str]:
        """ORTModule's interleaved ratio of each default model against its speed goal."""
        rows = [
            (model, run)
            for model, run in self.interleaved.items()
            if model in DEFAULT_MODELS and "ortmodule" in run.get("interval", {})
        ]
        if not rows:
            return []
        lines = [
            "## Speed goals",
            "",
            "ORTModule's interleaved step-time ratio against its goal (at or below): *met* when "
            "the whole 95% interval of the median is at or below the goal, *missed* when all of "
            "it is above, *not resolved* when this run cannot tell. More rounds narrow the "
            "interval: `python -m benchmarks.worker ratio --model M --modes eager ortmodule "
            "--rounds 40 --out r.json`.",
            "",
            "| model | goal | ORTModule | 95% interval | rounds | verdict |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for model, run in rows:
            goal = SPEED_GOALS.get(model, 1.0)
            low, high, coverage = run["interval"]["ortmodule"]
            lines.append(
                f"| {model} | {goal:.2f}x | {run['ratio']['ortmodule']:.2f}x | "
                f"{low:.2f}-{high:.2f}x ({coverage:.0%}) | {run.get('rounds', '')} | "
                f"{goal_verdict((low, high), goal)} |"
            )
        return [*lines, ""]

    def autocast_section(self) -> list[str]:
        """fp32 eager and the bfloat16 autocast modes, interleaved in one process per model."""
        if not self.autocast:
            return []
        flags = self.info.get("bf16_flags", [])
        native = [f for f in flags if f in NATIVE_BF16]
        have = ", ".join(f"`{f}`" for f in flags) or "none of them"
        lines = [
            "## bfloat16 autocast",
            "",
            'Forward and loss under `torch.autocast("cpu", torch.bfloat16)`, fp32 weights, '
            "backward and AdamW outside it. One process per model holds fp32 eager, eager, "
            "ORTModule and torch.compile under autocast and runs one step of each in turn"
            "; each ratio is the median of the per-round ratios, in brackets its 95% interval. In "
            "the *Training steps* table, the loss diff of ORTModule and torch.compile under "
            "autocast is against eager under autocast, that of eager under autocast against fp32.",
            "",
            f"- CPU bfloat16 features (`/proc/cpuinfo` flags of {', '.join(BF16_FLAGS)}): {have}; "
            f"PyTorch's CPU capability: {self.info.get('torch_cpu_capability', '?')}.",
            "- "
            + (
                f"Native bfloat16 ({', '.join(native)}): PyTorch's bf16 kernels use it."
                if native
                else "No native bfloat16 (no `avx512_bf16`, no `amx_bf16`): PyTorch's CPU kernels "
                "convert every bfloat16 operand to float32 and round each result back, so "
                "autocast is expected to be slower than fp32 here, and the goal *faster than fp32 "
                "eager* does not apply."
            ),
            "",
            "| model | fp32 eager step | eager bf16 vs fp32 | ORTModule bf16 vs eager bf16 | "
            "goal | ORTModule bf16 vs fp32 eager | torch.compile bf16 vs eager bf16 | "
            "max loss diff ORTModule vs eager bf16 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for model, run in self.autocast.items():
            if "error" in run:
                lines.append(f"| {model} | error: {_cell(run['error'])} |" + " |" * 6)
                continue
            vs = run.get("vs", {}).get("eager-bf16", {})
            goal = AUTOCAST_GOALS.get(model, 1.0)
            interval = vs.get("interval", {}).get("ortmodule-bf16")
            verdict = goal_verdict(interval[:2], goal) if interval else ""
            diff = vs.get("max_loss_diff", {}).get("ortmodule-bf16")
            lines.append(
                f"| {model} | {_ms(run.get('median_step_s', {}).get('eager'))} | "
                f"{_ratio_cell(run, 'eager-bf16')} | {_ratio_cell(vs, 'ortmodule-bf16')} | "
                f"{goal:.2f}x: {verdict} | {_ratio_cell(run, 'ortmodule-bf16')} | "
                f"{_ratio_cell(vs, 'compile-bf16')} | {'' if diff is None else f'{diff:.1e}'} |"
            )
        return [*lines, ""]

    def main_table(self) -> str:
        rows = [
            "| model | mode | median step | vs eager | first step | peak RSS | max loss diff vs eager |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for model in WORKLOADS:
            for mode in MODE_TITLES:
                run = self.runs.get((model, mode))
                if run is None:
                    continue
                if "error" in run:
                    rows.append(
                        f"| {model} | {MODE_TITLES[mode]} | failed: {_cell(run['error'])} | | | | |"
                    )
                    continue
                warm = mode == "ortmodule-warm"
                ratio = self.ratio(model, mode)
                compared = (
                    "compile",
                    "ortmodule",
                    "ortmodule-label-off",
                    "ortmodule-padding",
                    "ortmodule-level1",
                    "ortmodule-level1-auto",
                    "ortmodule-level2",
                    "eager-checkpoint",
                    *(m for m in MODE_TITLES if m.endswith("-bf16")),
                )
                diff = self.loss_diff(model, mode) if mode in compared else None
                first = _seconds(run.get("first_step_s"))
                if mode.startswith("compile"):
                    first += " (compiles)"
                elif warm:
                    first += " (export from cache)"
                elif mode.startswith("ortmodule") and mode != "ortmodule-label-off":
                    first += " (cold: export + build)"
                rows.append(
                    "| "
                    + " | ".join(
                        [
                            model,
                            MODE_TITLES[mode],
                            "" if warm else _ms(run.get("median_step_s")),
                            "" if ratio is None or warm else f"{ratio:.2f}x",
                            first,
                            f"{run['peak_rss_mib']:.0f} MiB" if "peak_rss_mib" in run else "",
                            "" if diff is None else f"{diff:.1e}",
                        ]
                    )
                    + " |"
                )
        return "\n".join(rows)

    def scale_section(self) -> list[str]:
        """``--scale``: time to first step by phase, step time against eager and torch.compile,
        and peak RSS of the build and of the steps, per real-size model and mode."""
        models = [m for m in SCALE_MODELS if any(k == m for k, _ in self.runs)]
        if not models:
            return []
        lines = [
            "## Real sizes (`--scale`)",
            "",
            "One fresh process per (model, mode). *Export*, *graph build* and *session creation* "
            "are ORTModule's own phase timer (`ORTModule._runner.last_times`, the INFO summary); "
            "*calibrations* are the kernel-choice measurements (`ORTMODULE_KERNEL_CHOICE=auto`), "
            "each timed in `kernel_choice.calibration_seconds()`, and are part of the export (or "
            "graph build) time beside them. *Build peak* is the process's high-water mark after "
            "the first step (the model, the first step, and for ORTModule the export, gradient "
            "build and session); *steps peak* is the largest RSS sampled every 20 ms during the "
            "later steps. Step time is the median of the measured steps; for ORTModule the "
            "in-engine thread trial (`ORTMODULE_TORCH_THREADS_IN_ENGINE=auto`, 12 steps) may "
            "still be choosing during so few steps.",
            "",
        ]
        for model in models:
            lines += [
                f"### {model}",
                "",
                "| mode | first step | export | graph build | session creation | calibrations "
                "| median step | vs eager | vs compile | build peak | steps peak | max loss diff |",
                "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            compile_run = self.runs.get((model, "compile"), {})
            for mode in SCALE_MODES:
                run = self.runs.get((model, mode))
                if run is None:
                    continue
                if "error" in run:
                    lines.append(
                        f"| {MODE_TITLES[mode]} | failed: {_cell(run['error'])} |" + " |" * 11
                    )
                    continue
                phases = run.get("phases", {})
                calibrations = run.get("calibrations", [])
                measured = [c for c in calibrations if c.get("seconds")]
                calib = ""
                if calibrations:
                    total = sum(c["seconds"] for c in measured)
                    calib = f"{_seconds(total)}: " + ", ".join(
                        f"{c['op']} {c['size']} {_seconds(c['seconds'])} -> {c['route']}"
                        for c in measured
                    )
                    if len(measured) < len(calibrations):
                        calib += f" ({len(calibrations) - len(measured)} from the cache)"
                warm = mode == "ortmodule-warm"
                ratio = None if warm else self.ratio(model, mode)
                vs_compile = None
                if not warm and "median_step_s" in run and "median_step_s" in compile_run:
                    vs_compile = run["median_step_s"] / compile_run["median_step_s"]
                diff = self.loss_diff(model, mode) if mode != "eager" and not warm else None
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            MODE_TITLES[mode],
                            _seconds(run.get("first_step_s")),
                            _seconds(phases.get("export")),
                            _seconds(phases.get("graph build")),
                            _seconds(phases.get("session creation")),
                            _cell(calib),
                            "" if warm else _seconds(run.get("median_step_s")),
                            "" if ratio is None else f"{ratio:.2f}x",
                            "" if vs_compile is None else f"{vs_compile:.2f}x",
                            _mib(run.get("peak_rss_first_step_mib")),
                            _mib(run.get("peak_rss_steps_mib")),
                            "" if diff is None else f"{diff:.1e}",
                        ]
                    )
                    + " |"
                )
            lines += ["", *self._warm_start_lines(model)]
        return lines

    def _warm_start_lines(self, model: str) -> list[str]:
        """The warm start against the cold one: whole first steps, and what each adds to a
        step (its first step less the cold run's median step), which the step itself does not
        hide."""
        cold, warm = (
            self.runs.get((model, "ortmodule"), {}),
            self.runs.get((model, "ortmodule-warm"), {}),
        )
        keys = ("first_step_s",)
        if not all(k in cold and k in warm for k in keys) or "median_step_s" not in cold:
            return []
        step = cold["median_step_s"]
        cold_start, warm_start = cold["first_step_s"] - step, warm["first_step_s"] - step
        return [
            f"Warm start: a first step of {_seconds(warm['first_step_s'])}, "
            f"{warm['first_step_s'] / cold['first_step_s']:.0%} of the cold one's "
            f"{_seconds(cold['first_step_s'])}; beyond one step ({_seconds(step)}, the cold run's "
            f"median), {_seconds(warm_start)} against {_seconds(cold_start)} "
            f"({warm_start / cold_start:.0%}).",
            "",
        ]

    def label_sparsity_section(self) -> list[str]:
        rows = []
        for model in WORKLOADS:
            on, off = (
                self.runs.get((model, "ortmodule"), {}),
                self.runs.get((model, "ortmodule-label-off"), {}),
            )
            if "median_step_s" not in on or "median_step_s" not in off:
                continue
            speedup = off["median_step_s"] / on["median_step_s"]
            on_eager, off_eager = (
                self.ratio(model, "ortmodule"),
                self.ratio(model, "ortmodule-label-off"),
            )
            rows.append(
                f"| {model} | {_ms(on['median_step_s'])} | {_ms(off['median_step_s'])} | "
                f"**{speedup:.2f}x** | "
                + ("" if on_eager is None else f"{on_eager:.2f}x")
                + " | "
                + ("" if off_eager is None else f"{off_eager:.2f}x")
                + " |"
            )
        if not rows:
            return []
        return [
            "## Label sparsity",
            "",
            "The same ORTModule run with the label-sparsity optimizer on (the default) and off "
            "(`ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER=0`). With it on, the engine computes the loss, "
            "and the vocabulary projection feeding it, on the labelled tokens only. *speed-up* is "
            "off / on; the last two columns are each run's step time as a multiple of eager's.",
            "",
            "| model | on: median step | off: median step | speed-up | on vs eager | off vs eager |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
        ]

    def phase_table(self) -> str:
        rows = [
            "| model | cache | export | graph build | session creation | first step (all of it) |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for model in WORKLOADS:
            for mode, label in (
                ("ortmodule", "cold (empty)"),
                ("ortmodule-warm", "warm (prefilled)"),
            ):
                run = self.runs.get((model, mode))
                if not run or "error" in run:
                    continue
                p = run.get("phases", {})
                rows.append(
                    f"| {model} | {label} | {_seconds(p.get('export'))} | {_seconds(p.get('graph build'))} | "
                    f"{_seconds(p.get('session creation'))} | {_seconds(run.get('first_step_s'))} |"
                )
        return "\n".join(rows)

    def overhead_section(self) -> list[str]:
        eager, ort = self.overhead.get("eager", {}), self.overhead.get("ortmodule", {})
        out = [
            "## Python overhead per step (tiny model)",
            "",
            f"{TINY.description}, forward + backward (no optimizer), median of {ort.get('measured', '?')} "
            "steps after warmup, one process per mode. On a model this small nearly all the time is "
            "per-step work rather than arithmetic: eager's is PyTorch's own dispatch and autograd; "
            "ORTModule's is flattening the inputs, handing tensors to the engine by DLPack, the "
            "engine's own run_forward/run_backward and the autograd bridge.",
            "",
        ]
        for what, run in (("eager", eager), ("ortmodule", ort)):
            if "error" in run:
                out += [f"- {MODE_TITLES[what]} failed: {run['error']}", ""]
        if "median_us" in eager and "median_us" in ort:
            engine = ort.get("engine_us")
            python = ort["median_us"] - engine if engine is not None else None
            out += [
                "| | µs per step |",
                "| --- | ---: |",
                f"| PyTorch eager | {eager['median_us']:.0f} |",
                f"| ORTModule | {ort['median_us']:.0f} ({ort['median_us'] / eager['median_us']:.1f}x eager) |",
                f"| of which the engine (run_forward + run_backward) | {_num(engine)} |",
                f"| of which Python (flatten, DLPack, bookkeeping, autograd) | {_num(python)} |",
                "",
            ]
            cats = ort.get("cprofile_categories") or {}
            if cats:
                out += [
                    "Where ORTModule's step goes, by cProfile (self time per component; shares of the "
                    "profiled time, the profiler itself inflates Python code):",
                    "",
                    "| component | share |",
                    "| --- | ---: |",
                    *(f"| {name} | {share * 100:.0f}% |" for name, share in cats.items()),
                    "",
                ]
            ours = ort.get("cprofile_ours") or []
            if ours:
                out += ["Our own functions with the most self time:", ""]
                out += [f"- `{r['function']}`: {r['share'] * 100:.1f}%" for r in ours]
                out.append("")
        return out

    def profile_section(self) -> list[str]:
        run = self.profile
        if run is None:
            return []
        out = ["## Where the time goes: GPT decoder under ORTModule", ""]
        if "error" in run:
            return [*out, f"The profiled run failed: {run['error']}", ""]
        step = run.get("mean_step_s")
        engine = run.get("engine_s_per_step")
        optim = run.get("mean_optimizer_s")
        prof = run.get("profile", {})
        out += [
            f"One extra process with ONNX Runtime's profiler on (`SessionOptions.enable_profiling`), "
            f"{run['warmup']} warmup + {run['measured']} measured steps; profiling slows the engine, "
            "so these figures are for the split, not for speed. It slows the PyTorch functions "
            "that the `ATen` nodes run most, up to 40x (a cross-entropy backward: 25 ms against "
            "0.6): `python -m benchmarks.breakdown` times those unprofiled.",
            "",
            "| part of a training step | ms per step | share |",
            "| --- | ---: | ---: |",
        ]
        if step and engine is not None and optim is not None:
            python = step - engine - optim
            for name, value in (
                ("engine: run_forward + run_backward", engine),
                ("AdamW step + zero_grad (PyTorch)", optim),
                ("the rest: Python side of ORTModule, autograd, the loss", python),
                ("whole step (mean over the measured steps)", step),
            ):
                out.append(f"| {name} | {value * 1e3:.1f} | {value / step * 100:.0f}% |")
        out += [
            "",
            f"Engine kernel time by operator (per step, {prof.get('kernel_us_per_step', 0) / 1e3:.1f} ms of "
            "kernels in all, averaged over every step the profiled session ran, the first one included):",
            "",
            "| operator | ms per step | share of kernel time | nodes per step |",
            "| --- | ---: | ---: | ---: |",
        ]
        for op in prof.get("operators", []):
            out.append(
                f"| {op['op']} | {op['us_per_step'] / 1e3:.2f} | {op['share'] * 100:.1f}% | {op['nodes_per_step']:.0f} |"
            )
        out.append("")
        return out

    def micro_section(self) -> list[str]:
        if not self.micro:
            return []
        out = [
            "## Micro-benchmarks",
            "",
            "Each `benchmarks/bench_*.py` that has a `run()` function, in its own process.",
            "",
        ]
        for name, run in self.micro.items():
            out += [f"### {name}", ""]
            if run.get("doc"):
                out += [run["doc"], ""]
            if "error" in run:
                out += [f"Failed: {run['error']}", ""]
            elif "skipped" in run:
                out += [f"Skipped: {run['skipped']}", ""]
            else:
                out += [*_value_table(run.get("result")), ""]
        return out

    def notes(self) -> list[str]:
        found = []
        for (model, mode), run in self.runs.items():
            if "error" in run:
                found.append(f"- {model}, {MODE_TITLES[mode]}: {run['error']}")
        for name, run in {
            **self.micro,
            **{f"overhead {k}": v for k, v in self.overhead.items()},
        }.items():
            if "error" in run:
                found.append(f"- {name}: {run['error']}")
            elif "skipped" in run:
                found.append(f"- {name}: skipped ({run['skipped']})")
        return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _ratio_cell(run: dict[str, Any], mode: str) -> str:
    """``0.98x (0.93-1.03)``: an interleaved median ratio and its 95% interval."""
    ratio = run.get("ratio", {}).get(mode)
    if ratio is None:
        return ""
    interval = run.get("interval", {}).get(mode)
    return f"{ratio:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _seconds(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value:.0f} MiB"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return _cell(str(value))


def _value_table(value: Any) -> list[str]:
    """A flat dict as two columns; a dict of dicts as rows x columns; anything else as text."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        columns: list[str] = []
        for row in value.values():
            columns += [c for c in row if c not in columns]
        lines = ["| | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
        for key, row in value.items():
            lines.append(
                f"| {_cell(str(key))} | " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |"
            )
        return lines
    if isinstance(value, dict):
        return [
            "| | |",
            "| --- | ---: |",
            *(f"| {_cell(str(k))} | {_fmt(v)} |" for k, v in value.items()),
        ]
    return ["```", str(value), "```"]


def _nox_equivalent(command: str) -> str:
    args = command.removeprefix("python -m benchmarks").strip()
    return "nox -s bench" + (f" -- {args}" if args else "")


def _bytecode_line(info: dict[str, Any]) -> str:
    cached, found = info.get("bytecode_cached", (0, 0))
    unset = "" if not info.get("dont_write_bytecode") else ", `PYTHONDONTWRITEBYTECODE` set"
    if found and cached == found:
        state = "cached (`.pyc` current)"
    else:
        state = (
            f"cached for {cached} of {found}: the others' source is compiled again in every "
            "process, inside first steps (`python -m compileall` over the environment caches it, "
            "as `pip install` does)"
        )
    return (
        f"- Python bytecode of the modules first steps import (the model's code, torch.onnx's "
        f"exporter, ORTModule's): {state}{unset}"
    )


def write_report(report: Report, path: Path) -> str:
    info = report.info
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    cores = f"{info['cores']} cores"
    if info["usable_cores"] != info["cores"]:
        cores += f" ({info['usable_cores']} usable by this process)"
    memory = f", {info['memory_gib']:.0f} GiB memory" if info["memory_gib"] else ""
    load = ", ".join(f"{x:.2f}" for x in report.load_before)
    load_after = ", ".join(f"{x:.2f}" for x in report.load_after) if report.load_after else "?"
    lines = [
        f"# Benchmarks: {path.stem}",
        "",
        f"- Machine: {info['cpu']}, {cores}{memory}; {info['os']}; "
        f"{'CUDA available (not used)' if info['cuda'] else 'no GPU'}",
        f"- Versions: {versions}",
        f"- CPU bfloat16 features: {', '.join(info.get('bf16_flags', [])) or 'none'} "
        f"(of {', '.join(BF16_FLAGS)}); PyTorch CPU capability "
        f"{info.get('torch_cpu_capability', '?')}",
        "- Intra-op threads per process (PyTorch and the engine alike): "
        + (
            f"{report.threads} (`--threads {report.threads}`)"
            if report.threads
            else f"{info['torch_threads']} (PyTorch's default)"
        ),
        _bytecode_line(info),
        f"- Suite: {'full' if report.full else 'quick'}, {report.seconds / 60:.1f} minutes in all",
        f"- Load average (1, 5, 15 min): {load} at the start, {load_after} at the end "
        "(the suite's own processes count in the second)",
        f"- Command: `{report.command}` (or `{_nox_equivalent(report.command)}`), from the repository root",
        "- ORTModule runs use `ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`: a failure stops the run "
        "instead of timing PyTorch under ORTModule's name",
        *([f"- Note: {report.note}"] if report.note else []),
        "",
    ]
    if report.busy():
        lines += [
            f"> **Noisy numbers.** The load average shows other work on the {info['cores']} cores "
            "while this ran: other processes shared the CPU, so step times are "
            "inflated and jumpy. Compare ratios measured in the same run, and re-run on a quiet machine "
            "for absolute numbers. With more threads than free cores, PyTorch's OpenMP threads "
            "spin-wait for each other and eager steps stall; `--threads 1` avoids that.",
            "",
        ]
    lines += [
        "## Training steps",
        "",
        "Forward + backward + `torch.optim.AdamW` step, one fresh process per (model, mode), the same "
        "initial weights and batches in every process. *Median step* is over the measured steps after "
        "warmup; *first step* is the first call in a fresh process (for torch.compile it includes "
        "compilation with an empty inductor cache; for ORTModule the export, gradient-graph build and "
        "session creation; the warm row is a second process whose `ORTMODULE_CACHE_DIR` the cold run "
        "filled); *peak RSS* is the process's high-water mark (`ru_maxrss`, imports included); *max loss "
        "diff* is the largest |loss − eager loss| over the measured steps.",
        "",
    ]
    for model in WORKLOADS:
        if any(m == model for m, _ in report.runs):
            w = WORKLOADS[model]
            warmup, measured = w.steps(report.full)
            lines.append(
                f"- **{model}**: {w.description}; {warmup} warmup + {measured} measured steps"
            )
    lines += ["", report.main_table(), ""]
    lines += report.scale_section()
    lines += report.interleaved_section()
    lines += report.goals_section()
    lines += report.autocast_section()
    gpt_cold, gpt_warm = (
        report.runs.get(("gpt", "ortmodule"), {}),
        report.runs.get(("gpt", "ortmodule-warm"), {}),
    )
    if "phases" in gpt_cold and "phases" in gpt_warm:
        lines += [
            "## Time to first step",
            "",
            f"Time to export the GPT-style benchmark model: **{_seconds(gpt_cold['phases'].get('export'))} cold**, "
            f"**{_seconds(gpt_warm['phases'].get('export'))} warm** (loaded from `ORTMODULE_CACHE_DIR`). "
            "The cache skips the export only; the engine still builds the gradient graph and the session.",
            "",
            report.phase_table(),
            "",
        ]
    lines += report.label_sparsity_section()
    if report.overhead:
        lines += report.overhead_section()
    lines += report.profile_section()
    lines += report.micro_section()
    notes = report.notes()
    if notes:
        lines += ["## Failures", "", *notes, ""]
    lines += [
        "## Commands",
        "",
        "Each configuration ran as its own process (from the repository root):",
        "",
        "```bash",
        *report.commands,
        "```",
        "",
    ]
    text = "\n".join(lines)
    path.write_text(text)
    return text


if __name__ == "__main__":  # pragma: no cover - a module of the package, not a command
    sys.exit("run `python -m benchmarks`")
