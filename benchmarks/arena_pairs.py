"""The CPU engine's arena on and off, interleaved in one process (``ORTMODULE_CPU_MEM_ARENA``).

    python -m benchmarks.arena_pairs                      # GPT-2 124M, 6 rounds
    python -m benchmarks.arena_pairs --layers 4 --rounds 3

One ``GPT2LMHeadModel`` (GPT-2 small's config, batch 4 x 256, 2 threads) is wrapped twice: once
with the arena (``ORTMODULE_CPU_MEM_ARENA=1``) and once without (``=0``), both sharing the
weights and the export cache. After 3 warm-up steps each, the two take turns, ABBA, for
``--rounds`` rounds (forward + backward, gradients cleared between steps) and the median step of
each is printed. Steps in separate processes vary by up to 30 % on a 2-core machine; turns in
one process share its drift. Peak memory needs a process each: ``python -m benchmarks.worker
train --model gpt2_124m --mode ortmodule --sample-rss`` with the variable set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from .models import GPT2_BATCH, GPT2_SMALL, causal_lm_batch, gpt2_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=GPT2_SMALL["n_layer"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    from ortmodule import ORTModule

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = gpt2_model(dict(GPT2_SMALL, n_layer=args.layers))
    batch = causal_lm_batch(GPT2_SMALL["vocab_size"], GPT2_BATCH)
    wrapped = {}
    for setting in ("1", "0"):  # read when the ORTModule is made
        os.environ["ORTMODULE_CPU_MEM_ARENA"] = setting
        wrapped[setting] = ORTModule(model)
    times: dict[str, list[float]] = {"1": [], "0": []}

    def step(setting: str, i: int) -> float:
        _, kwargs = batch(i, False)
        start = time.perf_counter()
        wrapped[setting](**kwargs).loss.backward()
        took = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return took

    for setting in ("1", "0"):
        for i in range(3):
            step(setting, i)
    for i in range(args.rounds):
        for setting in ("1", "0", "0", "1"):
            times[setting].append(step(setting, i))
    for setting, label in (("1", "arena (=1)"), ("0", "no arena (=0)")):
        steps = " ".join(f"{t:.2f}" for t in times[setting])
        print(f"{label}: median {statistics.median(times[setting]):.3f} s  [{steps}]")


if __name__ == "__main__":
    main()
