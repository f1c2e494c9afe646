"""Load balance across ranks: LoadBalancingDistributedSampler against DistributedSampler.

Two length distributions: a long-tailed synthetic one (Pareto, shape 1.5) and a real one, the
word counts of every docstring in the Python standard library on this machine. For each world
size, two numbers per sampler (1.0 is perfect):

- rank balance: max / mean over ranks of the total complexity a rank receives in an epoch (with
  its lower bound: the longest sample plus the shortest ones for the rest of its rank);
- step balance: sum over steps of the slowest rank's batch / sum of the mean rank's batch, with
  16 samples per step: what a synchronous data-parallel step waits for.

Ours is measured both as a plain sampler (``DataLoader(batch_size=16)``) and through
``LoadBalancingDistributedBatchSampler`` with 16-sample batches.

    python benchmarks/bench_sampler.py          # quick
    python benchmarks/bench_sampler.py --full
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from pathlib import Path

import numpy as np
from torch.utils.data import DistributedSampler

from ortmodule_sampler import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
    fixed_size_batches,
)

BATCH = 16


def pareto_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.pareto(1.5, n) * 50 + 10).astype(np.int64)


def stdlib_docstring_lengths(max_files: int | None = None) -> np.ndarray:
    """Word counts of the module, class and function docstrings of the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    lengths: list[int] = []
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    lengths.append(len(doc.split()))
    return np.asarray(lengths, dtype=np.int64)


def rank_balance(lengths: np.ndarray, parts: list[list[int]]) -> float:
    loads = np.array([lengths[p].sum() for p in parts], dtype=float)
    return float(loads.max() / loads.mean())


def step_balance(lengths: np.ndarray, per_rank_steps: list[list[list[int]]]) -> float:
    steps = min(len(s) for s in per_rank_steps)
    cost = np.array([[lengths[b].sum() for b in s[:steps]] for s in per_rank_steps], dtype=float)
    return float(cost.max(0).sum() / cost.mean(0).sum())


def chunks(indices: list[int]) -> list[list[int]]:
    return [indices[k : k + BATCH] for k in range(0, len(indices), BATCH)]


def measure(lengths: np.ndarray, world_size: int) -> dict[str, float]:
    data = lengths.tolist()
    ours = LoadBalancingDistributedSampler(data, float, world_size=world_size, rank=0, seed=0)
    batched = LoadBalancingDistributedBatchSampler(ours, fixed_size_batches(BATCH)).partition()
    ours_parts = ours.partition()
    theirs = [
        list(DistributedSampler(data, num_replicas=world_size, rank=r, seed=0))
        for r in range(world_size)
    ]
    per_rank = -(-len(data) // world_size)
    mean_load = lengths.sum() / world_size
    best = max(1.0, (lengths.max() + (per_rank - 1) * lengths.min()) / mean_load)
    return {
        "rank balance, best possible": float(best),
        "rank balance, DistributedSampler": rank_balance(lengths, theirs),
        "rank balance, ours": rank_balance(lengths, ours_parts),
        "step balance, DistributedSampler": step_balance(lengths, [chunks(p) for p in theirs]),
        "step balance, ours": step_balance(lengths, [chunks(p) for p in ours_parts]),
        "step balance, ours batched": step_balance(lengths, batched),
    }


def run(quick: bool = True) -> dict[str, dict[str, float]]:
    """Balance ratios per (distribution, world size); 1.0 is perfect."""
    n = 20_000 if quick else 200_000
    distributions = {
        "pareto(1.5)": pareto_lengths(n),
        "stdlib docstrings": stdlib_docstring_lengths(400 if quick else None),
    }
    results: dict[str, dict[str, float]] = {}
    for name, lengths in distributions.items():
        for world_size in (8, 64):
            key = f"{name}, n={len(lengths)}, max/mean length={lengths.max() / lengths.mean():.0f}, world {world_size}"
            results[key] = measure(lengths, world_size)
    return results


def main() -> None:
    results = run(quick="--full" not in sys.argv)
    columns = list(next(iter(results.values())))
    print("| case | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for case, row in results.items():
        print(f"| {case} | " + " | ".join(f"{row[c]:.4f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
