"""Optimizer step time on CPU: FusedAdam against torch.optim.AdamW's three implementations.

Two parameter layouts: many small tensors (where per-tensor overhead dominates, as in a model of
many layers) and a few large ones (where memory bandwidth does). Each optimizer steps the same
parameters with fixed gradients; the time per step is the fastest of several rounds in which the optimizers take turns, and the ratios
to FusedAdam, all measured in this one process, are the numbers to compare across machines.

    python benchmarks/bench_optim.py            # quick
    python benchmarks/bench_optim.py --full
    python benchmarks/bench_optim.py --threads 1   # steadier on a busy machine
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from ortmodule_optim import FusedAdam

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "AdamW(foreach=False)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}


def layouts(quick: bool) -> dict[str, list[int]]:
    if quick:
        return {"many small (400 x 1k)": [1024] * 400, "few large (4 x 1M)": [1 << 20] * 4}
    return {"many small (2000 x 4k)": [4096] * 2000, "few large (8 x 2M)": [1 << 21] * 8}


def step_times(sizes: list[int], repeats: int) -> dict[str, float]:
    """Milliseconds per step of every optimizer on its own copy of the same parameters.

    The optimizers take turns, one step each per round, so a busy machine slows them alike; the
    fastest round counts.
    """
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    optimizers = {}
    for name, make in OPTIMIZERS.items():
        params = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizers[name] = make(params)
        for _ in range(2):  # state allocation, first-call costs
            optimizers[name].step()
    best = dict.fromkeys(optimizers, float("inf"))
    for _ in range(repeats):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def run(quick: bool = True) -> dict[str, dict[str, float]]:
    """Milliseconds per step for each layout and optimizer, plus each one's ratio to FusedAdam."""
    repeats = 30 if quick else 60
    results: dict[str, dict[str, float]] = {}
    for layout, sizes in layouts(quick).items():
        row = step_times(sizes, repeats)
        row.update({f"{name} / FusedAdam": row[name] / row["FusedAdam"] for name in OPTIMIZERS})
        results[layout] = row
    return results


def main() -> None:
    if "--threads" in sys.argv:
        torch.set_num_threads(int(sys.argv[sys.argv.index("--threads") + 1]))
    results = run(quick="--full" not in sys.argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print()
    print("| layout | " + " | ".join(f"{name} ms (x FusedAdam)" for name in OPTIMIZERS) + " |")
    print("|---|" + "---|" * len(OPTIMIZERS))
    for layout, row in results.items():
        cells = [f"{row[name]:.3f} ({row[f'{name} / FusedAdam']:.2f}x)" for name in OPTIMIZERS]
        print(f"| {layout} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
