"""Peak memory and step time of recompute: ORTModule levels 0/1/2 against eager checkpointing.

    python -m benchmarks.bench_memory                  # GPT benchmark size, batch 8
    python -m benchmarks.bench_memory --batch 16 --steps 6
    python -m benchmarks.bench_memory --model llama    # the tiny HF Llama of the benchmark suite

Each configuration runs in a fresh process. After the warm-up steps (export, graph build and
session creation are done, the optimizer state exists) the process's resident-set high-water
mark is reset (``/proc/self/clear_refs``) and the resident size taken as the baseline; the
peak above that baseline over the measured steps is the step's transient memory: activations
kept for the backward, gradients and workspace. So that resident memory follows live tensors,
the children run with ``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor of 64 KiB or more is its
own mapping, returned to the system when freed) and the engine's CPU arena off (an arena keeps
its high-water mark resident, which would hide the step's peak after the first step). Ratios are to ORTModule without recompute (for
the ORTModule rows) and to eager (for the eager rows), from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS = {
    "eager": ("eager", {}),
    "eager + checkpoint every layer": ("eager_ckpt", {}),
    "ORTModule, recompute off": ("ort", {}),
    "ORTModule, level 1": ("ort", {"ORTMODULE_MEMORY_OPT_LEVEL": "1"}),
    "ORTModule, level 2": ("ort", {"ORTMODULE_MEMORY_OPT_LEVEL": "2"}),
    "ORTModule, mem-efficient gradients": (
        "ort",
        {"ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "1"},
    ),
    "ORTModule, level 1 + mem-efficient gradients": (
        "ort",
        {"ORTMODULE_MEMORY_OPT_LEVEL": "1", "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "1"},
    ),
}


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    # "5" resets the peak RSS (VmHWM) to the current RSS (Linux 4.0+)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _model(name: str, batch: int, checkpointed: bool) -> tuple[Any, Any, Any]:
    """(model, make_batch(step) -> (args, kwargs), loss_of(output)) for ``name``."""
    import torch.utils.checkpoint

    if name == "llama":
        from benchmarks.models import WORKLOADS

        workload = WORKLOADS["llama"]
        model = workload.build(full=False)
        if checkpointed:  # Hugging Face's own per-layer activation checkpointing
            model.gradient_checkpointing_enable({"use_reentrant": False})
        return model, lambda step: workload.make_batch(step, False), lambda out: out.loss

    from ortmodule_testing.zoo import gpt_benchmark

    make_model, make_batch = gpt_benchmark(batch=batch)
    model = make_model()
    if checkpointed:
        for block in model.blocks:
            forward = block.forward
            block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(
                f, x, use_reentrant=False
            )
    return model, make_batch, lambda out: out[0]


def _worker(
    mode: str, batch: int, warmup: int, steps: int, threads: int, name: str = "gpt"
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, make_batch, loss_of = _model(name, batch, checkpointed=mode == "eager_ckpt")
    if mode == "ort":
        from ortmodule import ORTModule
        from ortmodule_exporter.engine import import_onnxruntime

        ort = import_onnxruntime()
        options_class = ort.SessionOptions

        def no_arena() -> Any:
            options = options_class()
            options.enable_cpu_mem_arena = False
            return options

        ort.SessionOptions = no_arena  # measurement only: see the module docstring
        model = ORTModule(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    baseline = 0
    for step in range(warmup + steps):
        if step == warmup:
            import gc

            gc.collect()
            reset_peak()
            baseline = status_kib("VmRSS")
        args, kwargs = make_batch(step)
        start = time.perf_counter()
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step >= warmup:
            times.append(time.perf_counter() - start)
    report: dict[str, Any] = {
        "peak_mib": (status_kib("VmHWM") - baseline) / 1024,
        "step_ms": statistics.median(times) * 1000,
        "losses": losses,
    }
    if mode == "ort":
        from ortmodule_memory import memory_report

        found = memory_report(model)
        report["plans"] = len(found.applied) if found else 0
        saved = found.saving_bytes() if found and found.applied else 0
        report["planned_saving_mib"] = None if saved is None else saved / 2**20
    return report


def measure(
    batch: int = 8, warmup: int = 2, steps: int = 5, threads: int = 2, model: str = "gpt"
) -> dict[str, Any]:
    """Run every configuration in its own process; configuration name -> its figures."""
    results = {}
    for name, (mode, env) in CONFIGS.items():
        cmd = [
            sys.executable, "-m", "benchmarks.bench_memory", "--worker", mode,
            "--batch", str(batch), "--warmup", str(warmup), "--steps", str(steps),
            "--threads", str(threads), "--model", model,
        ]  # fmt: skip
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("ORTMODULE_")}
        child_env.update(
            env, ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE", MALLOC_MMAP_THRESHOLD_="65536"
        )
        done = subprocess.run(cmd, env=child_env, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(lines[-1])
    return results


def run(quick: bool = True) -> dict[str, dict[str, float]]:
    """For ``python -m benchmarks``: peak step memory (MiB) and median step (ms) per configuration."""
    found = measure(steps=3 if quick else 8)
    return {
        name: {"peak above baseline (MiB)": r["peak_mib"], "median step (ms)": r["step_ms"]}
        for name, r in found.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        print(json.dumps(_worker(ns.worker, ns.batch, ns.warmup, ns.steps, ns.threads, ns.model)))
        return 0
    results = measure(ns.batch, ns.warmup, ns.steps, ns.threads, ns.model)
    for name, r in results.items():
        print(f"{name}: {r}", file=sys.stderr)
    print(_table(results, ns))
    return 0


def _table(results: dict[str, dict[str, Any]], ns: argparse.Namespace) -> str:
    described = {
        "gpt": f"GPT decoder (vocab 1024, d 256, 4 layers, seq 128), batch {ns.batch}",
        "llama": "tiny HF LlamaForCausalLM (vocab 1024, hidden 256, 4 layers, seq 128), batch 8",
    }
    rows = [
        f"{described[ns.model]}, "
        f"{ns.threads} threads, median of {ns.steps} steps after {ns.warmup} warm-up steps",
        "",
        "| configuration | peak above baseline (MiB) | vs reference | step (ms) | vs reference "
        "| plans applied | planned saving (MiB) | last loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        ref = results.get("eager" if name.startswith("eager") else "ORTModule, recompute off", r)
        planned = r.get("planned_saving_mib")
        rows.append(
            f"| {name} | {r['peak_mib']:.1f} | {r['peak_mib'] / ref['peak_mib']:.2f}x "
            f"| {r['step_ms']:.0f} | {r['step_ms'] / ref['step_ms']:.2f}x "
            f"| {r.get('plans', '')} | {'' if planned is None else f'{planned:.1f}'} "
            f"| {r['losses'][-1]:.6f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
