"""The side-by-side report: the table, the speed sentence, and the plots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..options import VARIABLES
from .config import TITLES
from .training import RunResult


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def loss_differences(a: RunResult, b: RunResult) -> list[float]:
    return [abs(x - y) for x, y in zip(a.losses, b.losses, strict=True)]


def format_table(eager: RunResult, ort: RunResult, recompute: RunResult | None = None) -> str:
    """The side-by-side table ``ortmodule demo`` prints (with the recompute run's rows if given)."""
    diffs = loss_differences(eager, ort)
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    phases = ", ".join(f"{name} {sec:.2f} s" for name, sec in ort.phases.items())
    rows: list[tuple[str, str, str, str]] = [
        ("final loss", f"{eager.losses[-1]:.4f}", f"{ort.losses[-1]:.4f}", ""),
        ("largest per-step loss difference", "", f"{diffs[worst]:.2e}", f"at step {worst + 1}"),
        (
            "median step time (fwd+bwd+AdamW)",
            _fmt_s(eager.median_step),
            _fmt_s(ort.median_step),
            f"{ort.median_step / eager.median_step:.2f}x eager",
        ),
        ("steps/s (median)", f"{1 / eager.median_step:.1f}", f"{1 / ort.median_step:.1f}", ""),
        (
            "time to first step",
            _fmt_s(eager.first_step),
            _fmt_s(ort.first_step),
            f"includes {phases}" if phases else "",
        ),
        ("total training time", _fmt_s(sum(eager.step_seconds)), _fmt_s(sum(ort.step_seconds)), ""),
        (
            "peak RSS of the run's process",
            f"{eager.peak_rss_mib:.0f} MiB",
            f"{ort.peak_rss_mib:.0f} MiB",
            "high-water mark, fresh process per run",
        ),
        (
            "RSS growth during training",
            f"{eager.peak_rss_mib - eager.rss_before_mib:.0f} MiB",
            f"{ort.peak_rss_mib - ort.rss_before_mib:.0f} MiB",
            "peak minus RSS before step 1",
        ),
    ]
    if recompute is not None:
        label = TITLES["recompute"]
        rows += [
            (
                f"{label}: median step time",
                "",
                _fmt_s(recompute.median_step),
                f"{recompute.median_step / ort.median_step:.2f}x ORTModule",
            ),
            (
                f"{label}: RSS growth during training",
                "",
                f"{recompute.peak_rss_mib - recompute.rss_before_mib:.0f} MiB",
                "memory-vs-time trade-off (ORTMODULE_MEMORY_OPT_LEVEL=1)",
            ),
            (
                f"{label}: largest loss difference",
                "",
                f"{max(loss_differences(eager, recompute)):.2e}",
                "vs eager",
            ),
        ]
        if recompute.cuda_peak_mib is not None:
            rows.append(
                (f"{label}: peak CUDA memory", "", f"{recompute.cuda_peak_mib:.0f} MiB", "")
            )
    if eager.cuda_peak_mib is not None and ort.cuda_peak_mib is not None:
        rows.append(
            (
                "peak CUDA memory (torch allocator)",
                f"{eager.cuda_peak_mib:.0f} MiB",
                f"{ort.cuda_peak_mib:.0f} MiB",
                "",
            )
        )
    header = ("", TITLES["eager"], TITLES["ortmodule"], "")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]
    lines = []
    for r in (header, *rows):
        cells = [r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2].rjust(widths[2]), r[3]]
        lines.append("  ".join(cells).rstrip())
        if r is header:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


#: the options that decide ORTModule's speed, reported with every speed figure
SPEED_OPTIONS = ("ORTMODULE_FUSED_ATTENTION", "ORTMODULE_KERNEL_CHOICE")


def speed_summary(
    eager: RunResult, ort: RunResult, threads: int, loads: tuple[float, float]
) -> str:
    """One honest sentence on speed: the ratio, and the settings and load that produced it."""
    ratio = ort.median_step / eager.median_step
    verdict = (
        f"{1 / ratio:.2f}x as fast as eager" if ratio < 1 else f"{ratio:.2f}x eager's step time"
    )
    defaults = {var.name: var.default for var in VARIABLES}
    settings = ", ".join(
        f"{name}={os.environ.get(name) or defaults.get(name)}" for name in SPEED_OPTIONS
    )
    return (
        f"Speed: ORTModule ran {verdict} (median step {_fmt_s(ort.median_step)} vs "
        f"{_fmt_s(eager.median_step)}), with {threads or torch.get_num_threads()} intra-op "
        f"threads each, {settings}; load average {loads[0]:.1f} before and {loads[1]:.1f} after "
        f"on {os.cpu_count()} CPUs. The two runs were sequential processes, so a busy machine "
        "skews the ratio; `python -m benchmarks.worker ratio --model gpt` interleaves them."
    )


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_losses(eager: RunResult, ort: RunResult, path: Path) -> Path | None:
    """Write the two loss curves (and their difference) to ``path``; None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    steps = range(1, len(eager.losses) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    top.plot(steps, eager.losses, label=TITLES["eager"], linewidth=2.5, alpha=0.6)
    top.plot(steps, ort.losses, label=TITLES["ortmodule"], linewidth=1.0, linestyle="--")
    top.set_ylabel("training loss (cross-entropy)")
    top.set_title("DemoGPT on the shipped corpus: PyTorch eager vs ORTModule")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(steps, loss_differences(eager, ort), color="tab:red", linewidth=1.0)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    bottom.set_ylabel("|loss difference|")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_tradeoff(results: dict[str, RunResult], path: Path) -> Path | None:
    """Memory (RSS growth) against median step time, one point per run; None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, r in results.items():
        x, y = r.median_step * 1e3, r.peak_rss_mib - r.rss_before_mib
        ax.scatter([x], [y], s=60)
        ax.annotate(TITLES.get(mode, mode), (x, y), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("RSS growth during training (MiB)")
    ax.set_title("Memory vs time")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def versions() -> str:
    from importlib import metadata

    parts = [f"torch {torch.__version__}"]
    for dist in ("onnxruntime-training-cpu", "onnxruntime-training"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)
