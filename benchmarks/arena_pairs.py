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

from .turns import gpt2_in_turns


def main() -> None:
    args, model, timed = gpt2_in_turns(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    from ortmodule import ORTModule

    wrapped = {}
    for setting in ("1", "0"):  # read when the ORTModule is made
        os.environ["ORTMODULE_CPU_MEM_ARENA"] = setting
        wrapped[setting] = ORTModule(model)
    times: dict[str, list[float]] = {"1": [], "0": []}

    def step(setting: str, i: int) -> float:
        return timed(wrapped[setting], i)

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
