"""``run_demo``: what ``ortmodule demo`` runs: both trainings, then the report."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import torch

from .config import LOSS_TOLERANCE, MODES, DemoConfig, config_from
from .data import CharTokenizer, load_corpus, make_batches
from .model import build_model
from .report import (
    format_table,
    loss_differences,
    plot_losses,
    plot_tradeoff,
    speed_summary,
    versions,
)
from .training import run_child


def run_demo(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Train twice (eager, then ORTModule), print the table, write the plot; 0 when losses match."""
    out_stream = stdout if stdout is not None else sys.stdout
    config = config_from(args)

    def say(text: str = "") -> None:
        out_stream.write(text + "\n")
        out_stream.flush()

    try:
        config.check()
    except ValueError as err:
        say(f"ortmodule demo: {err}")
        return 2
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = DemoConfig(**{**asdict(config), "out": str(out)})

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text))
    try:
        batches = make_batches(ids, config)
    except ValueError as err:
        say(f"ortmodule demo: {err}")
        return 2
    model = build_model(config, tokenizer.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    say(
        f"DemoGPT: {config.layers} layers, d_model {config.d_model}, {config.heads} heads, "
        f"{params / 1e6:.2f} M parameters, {tokenizer.vocab_size} characters"
    )
    say(
        f"Training {config.steps} steps of {config.batch_size} x {config.seq_len} characters on "
        f"{len(text) / 1024:.0f} KB of text, AdamW lr {config.lr}, device {config.device}"
    )
    say(
        f"{versions()}; {os.cpu_count()} CPUs; each run in a fresh process, same weights and batches"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        say(
            f"Note: the machine is busy (load average {load:.1f} on {os.cpu_count()} CPUs), so times are noisy."
        )
    say()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ortmodule-demo-") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(asdict(config)))
        torch.save(model.state_dict(), work / "init.pt")
        torch.save(batches, work / "batches.pt")
        try:
            results = {mode: run_child(mode, work) for mode in MODES}
        except RuntimeError as err:
            say(f"ortmodule demo: {err}")
            return 1
    eager, ort = results["eager"], results["ortmodule"]
    diffs = loss_differences(eager, ort)
    if "recompute" in results:  # recompute must not change the losses either
        diffs += loss_differences(eager, results["recompute"])
    worst = max(diffs)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0

    say()
    say(format_table(eager, ort, results.get("recompute")))
    say()
    if ort.engine_ran:
        say(
            "ORTModule ran every step in ONNX Runtime (ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE: "
            "a fallback to PyTorch would have stopped the run)."
        )
    else:
        say("ORTModule did NOT run in ONNX Runtime: the comparison below is not meaningful.")
    say(speed_summary(eager, ort, config.threads, (load, load_after)))
    say()
    matched = (
        all(r.engine_ran for mode, r in results.items() if mode != "eager")
        and worst <= LOSS_TOLERANCE
        and all(math.isfinite(loss) for r in results.values() for loss in r.losses)
    )
    if matched:
        say(
            f"The losses match: the largest per-step difference is {worst:.2e} (tolerance {LOSS_TOLERANCE:g})."
        )
    else:
        say(
            f"The losses DIFFER: the largest per-step difference is {worst:.2e}, above the tolerance "
            f"{LOSS_TOLERANCE:g}. Please report it with the output of `ortmodule doctor`."
        )
    plot = plot_losses(eager, ort, out / "loss_curve.png")
    if plot is not None:
        say(f"Loss curves: {plot}")
    else:
        say("Loss curves: not drawn, matplotlib is not installed (pip install 'ortmodule[demo]').")
    tradeoff = plot_tradeoff(results, out / "memory_vs_time.png")
    if tradeoff is not None:
        say(f"Memory vs time: {tradeoff}")
    summary = {
        "config": asdict(config),
        "runs": {mode: asdict(r) for mode, r in results.items()},
        "max_loss_difference": worst,
        "losses_match": matched,
    }
    results_path = out / "demo_results.json"
    results_path.write_text(json.dumps(summary, indent=1))
    say(f"Results: {results_path}")
    for path in ort.onnx_files:
        say(f"ONNX model: {path}")
    if ort.text:
        say()
        say(f"Text from the ORTModule model (inference graph, sampled with seed {config.seed}):")
        say()
        for line in ort.text.splitlines():
            say(f"    {line}")
        if eager.text:
            same = "the same" if eager.text == ort.text else "different"
            say()
            say(f"(The eager model's sample with the same seed is {same}.)")
    say()
    say(f"Done in {time.perf_counter() - started:.0f} s.")
    return 0 if matched else 1
